"""Does AMX tile work overlap AVX512 vector work on this CPU? (tile_load_overlap.c)

The fact behind the kernels' interleaving (cpu_paged_prefill.c, cpu_tile_gemm.c's epilogue,
cpu_paged_decode_amx.h): here a tile load holds up the vector work issued after it, while tile
products alone overlap it. For each kind of tile work the table gives one iteration's
nanoseconds with the tile work alone, the vector work alone, both one after the other, and both
cut into 8 interleaved pieces, beside the sum and the larger of the two alone.

    python benchmarks/benchmark_tile_load_overlap.py [--output-json benchmarks/results/tile_load_overlap.json]
"""

import argparse
import ctypes
import json
import sys
from pathlib import Path

from vllm.platforms.c_library import CFunction, CLibrary

KINDS = {"loads and products": 0, "products only": 1, "loads only": 2}
MODES = ("tile alone", "vector alone", "one after the other", "interleaved")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vector-rows", type=int, default=40, help="rows of vector work per iteration")
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.vector_rows < 8 or args.vector_rows % 8:
        parser.error("--vector-rows must be a positive multiple of 8 (it is cut into 8 pieces)")
    lib = CLibrary(Path(__file__).with_name("tile_load_overlap.c"), "nothing to measure", {
        "overlap_ns": CFunction([ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64], ctypes.c_double),
    }).get()
    if lib is None:
        print("the C benchmark could not be built", file=sys.stderr)
        return 1
    results = {}
    print(f"{'tile work':20s}" + "".join(f"{m:>22s}" for m in MODES) + f"{'sum':>8s}{'max':>8s}  (ns)")
    for name, kind in KINDS.items():
        ns = [lib.overlap_ns(kind, mode, args.vector_rows, args.iterations) for mode in range(len(MODES))]
        if ns[0] < 0:
            print("no AMX tile state on this machine", file=sys.stderr)
            return 1
        results[name] = dict(zip(MODES, ns))
        print(f"{name:20s}" + "".join(f"{x:22.1f}" for x in ns) + f"{ns[0] + ns[1]:8.1f}{max(ns[:2]):8.1f}")
    if args.output_json:
        args.output_json.write_text(json.dumps({"args": {"vector_rows": args.vector_rows, "iterations":
                                                         args.iterations}, "ns_per_iteration": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
