/* Part of cpu_tile_gemm.c: the product on AMX tiles (amx_gemm, HAVE_TILE_GEMM_AMX where the
 * CPU has them), and tile_gemm_use_amx.
 *
 * One AMX tile product multiplies all the rows (16 at a time) by a 32 x 16 block of W at once,
 * so the weights stream at memory speed; the packed layout makes each tile one 1 KB load. Each
 * thread computes groups of column blocks in its four accumulator tiles: two to four blocks
 * for up to 16 rows (sharing each load of x's tile; units_per_group), two blocks for 17-32 rows
 * (each W tile used by x's two).
 * Past 16 rows, each pair of column blocks meets every 32-row slab of x in turn (a last slab of
 * 1-16 rows takes one tile of x). x is loaded with the streaming hint, so that the pair's W
 * tiles stay in L1 for the next slab where the pair fits in it (K = 576: 36 KB of a 48 KB L1);
 * loaded plainly, x evicts them and every tile load goes to L2.
 */
#ifndef VLLM_CPU_TILE_GEMM_AMX_H
#define VLLM_CPU_TILE_GEMM_AMX_H

#ifdef VLLM_HAVE_AMX
#define HAVE_TILE_GEMM_AMX 1

#define GROUP 4  /* output blocks of 16 columns per x-tile load */
#define L1_BYTES (48 * 1024)  /* a core's L1 data cache on AMX Xeons (Sapphire Rapids and later) */

static int amx_ready; /* set by tile_gemm_use_amx() */

/* Lets the products take the AMX tiles (where the CPU and Linux allow it) or not; 1 if they do. */
int tile_gemm_use_amx(int enable) { return amx_ready = enable && amx_request_tiles(); }

/* One thread's tiles: `rows` of the accumulators and of x's tiles, 16 pair rows for W's. */
static void configure_tiles(int64_t first_rows, int64_t second_rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;  /* 16 floats, 32 bf16 or 16 bf16 pairs */
    if (second_rows == 0) {  /* accumulators 0-3 and x's tile 4: all rows; W's tiles 5-7 */
        for (int t = 0; t < 8; ++t) cfg.rows[t] = t < 5 ? (uint8_t)first_rows : 16;
    } else {  /* accumulators 0-1 and x's tile 4: rows 0-15; 2-3 and 5: the rest; W's 6-7 */
        const uint8_t rows[8] = {16, 16, (uint8_t)second_rows, (uint8_t)second_rows, 16,
                                 (uint8_t)second_rows, 16, 16};
        memcpy(cfg.rows, rows, sizeof rows);
    }
    amx_load_config(&cfg);
}

/* y[:, 16 b0 : 16 (b0 + blocks)] of `out` (float32, GROUP * 16 columns a row), plus bias. */
static void store_group(const float *out, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                        int64_t b0, int64_t blocks) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < blocks * 16; c += 16) {
            const int64_t j = b0 * 16 + c;
#ifdef __AVX512BF16__
            __m512 v = _mm512_loadu_ps(out + r * GROUP * 16 + c);
            if (bias) v = _mm512_add_ps(v, bf16x16_to_float(bias + j));
            store_bf16x16(y + r * n + j, v);
#else
            for (int64_t i = 0; i < 16; ++i)
                y[r * n + j + i] = float_to_bf16(out[r * GROUP * 16 + c + i] + (bias ? bf16_to_float(bias[j + i]) : 0.0f));
#endif
        }
}

/* y[:, 16 j0 : 16 (j0 + pairs)] = silu(gate) * up, where `out` (float32, GROUP * 16 columns a
 * row) holds gate blocks j0 .. j0 + pairs - 1 and then the up blocks of the same columns; each
 * value rounded to bf16 where torch rounds it (gate_up's output, silu's, the product). */
static void store_silu_mul(const float *out, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                           int64_t j0, int64_t pairs) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t p = 0; p < pairs; ++p) {
            const float *gate = out + r * GROUP * 16 + 16 * p, *up = gate + 16 * pairs;
            const int64_t j = (j0 + p) * 16;
#ifdef VLLM_LAYER_OPS_X16
            __m512 g = _mm512_loadu_ps(gate), u = _mm512_loadu_ps(up);
            if (bias) {
                g = _mm512_add_ps(g, bf16x16_to_float(bias + j));
                u = _mm512_add_ps(u, bf16x16_to_float(bias + n + j));
            }
            store_bf16x16(y + r * n + j, silu_mul_x16(g, u));
#else
            for (int64_t i = 0; i < 16; ++i) {
                const uint16_t g = round_bf16(gate[i] + (bias ? bf16_to_float(bias[j + i]) : 0.0f));
                const uint16_t u = round_bf16(up[i] + (bias ? bf16_to_float(bias[n + j + i]) : 0.0f));
                y[r * n + j + i] = round_bf16(mul_bf16(round_bf16(silu(bf16_to_float(g))), u));
            }
#endif
        }
}

#define W_TILE(B) (packed + (group_block(fused, b0, pairs, half, (B)) * kblocks + kb) * 512)

static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* A group's products, stored from the tiles to `out` (float32, GROUP * 16 columns a row), on
 * their way to y: rows [done, rows) still to go. They are written while the tiles compute the
 * next group's (or slab's) products, a few rows after each step over k: a tile load holds up
 * the vector work issued after it, so written in one go they would wait for the tiles and the
 * tiles for them; interleaved, the tile unit multiplies while the vector units convert and store
 * (benchmarks/benchmark_tile_load_overlap.py measures whether the two overlap on a CPU). */
struct epilogue {
    const float *out;
    const uint16_t *bias;
    uint16_t *y;                /* y's row of out's first row */
    int64_t rows, done, n;      /* n: y's columns */
    int64_t first, units;       /* store_group's b0 and blocks, or store_silu_mul's j0 and pairs */
    int fused;
};

/* Writes up to `count` more rows of e to y. */
static inline void epilogue_rows(struct epilogue *e, int64_t count) {
    const int64_t r = e->done, end = e->rows - r < count ? e->rows : r + count;
    if (r >= end) return;
    if (e->fused)
        store_silu_mul(e->out + r * GROUP * 16, e->bias, e->y + r * e->n, end - r, e->n, e->first, e->units);
    else
        store_group(e->out + r * GROUP * 16, e->bias, e->y + r * e->n, end - r, e->n, e->first, e->units);
    e->done = end;
}

/* Up to 16 rows: the blocks of a group (up to four) share each load of x's tile. n: W's rows;
 * fused: y gets silu(gate) * up, (m, n / 2). */
static void gemm_16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                    int64_t m, int64_t n, int64_t k, int fused) {
    const int64_t kblocks = k / 32, nblocks = n / 16, half = nblocks / 2, threads = omp_get_max_threads();
    /* the unit: a block, or (fused) a pair of gate and up blocks */
    const int64_t units = fused ? half : nblocks;
    const int64_t size = fused ? units_per_group(units, threads, 1, GROUP / 2) : units_per_group(units, threads, 2, GROUP);
    const int64_t groups = (units + size - 1) / size;
    const int64_t rows_per_step = (m + kblocks - 1) / kblocks;  /* the last group's epilogue in one pass over k */
    #pragma omp parallel
    {
        configure_tiles(m, 0);
        float out[16 * GROUP * 16];
        struct epilogue last = {0};  /* the last group's products, written during this group's */
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t b0 = g * size, count = units - b0 < size ? units - b0 : size;
            const int64_t pairs = fused ? count : 0, blocks = fused ? 2 * count : count;
            zero_accumulators();
            for (int64_t kb = 0; kb < kblocks; ++kb) {
                _tile_loadd(4, x + kb * 32, k * 2);
                _tile_loadd(5, W_TILE(0), 64);
                _tile_dpbf16ps(0, 4, 5);
                if (blocks > 1) { _tile_loadd(6, W_TILE(1), 64); _tile_dpbf16ps(1, 4, 6); }
                if (blocks > 2) { _tile_loadd(7, W_TILE(2), 64); _tile_dpbf16ps(2, 4, 7); }
                if (blocks > 3) { _tile_loadd(5, W_TILE(3), 64); _tile_dpbf16ps(3, 4, 5); }
                epilogue_rows(&last, rows_per_step);
            }
            /* (the last group's rows are all written by now: out is free) */
            _tile_stored(0, out, GROUP * 64);
            _tile_stored(1, out + 16, GROUP * 64);
            _tile_stored(2, out + 32, GROUP * 64);
            _tile_stored(3, out + 48, GROUP * 64);
            last = fused ? (struct epilogue){out, bias, y, m, 0, n / 2, b0, pairs, 1}
                         : (struct epilogue){out, bias, y, m, 0, n, b0, blocks, 0};
        }
        epilogue_rows(&last, m);
        _tile_release();
    }
}

/* More than 16 rows, in slabs of 32 (the last of 1-32): two tiles of x, each W tile used by
 * both, two blocks of 16 columns at a time. Each thread takes pairs of column blocks and passes
 * every slab of x by them, so a pair's W tiles are read from memory once and then from L2; the
 * next pair's are prefetched into L2 meanwhile, spread over the slabs. A last slab of 1-16 rows
 * takes one tile of x, so no rows need a second pass over W.
 *
 * Where a pair's W tiles do not fit in L1 (k > 768: SmolLM2's down_proj), every slab reads them
 * from L2 anyway, and all of x (1.5 MB at 512 rows) crowds L2 beside them. There the threads
 * split the slabs instead, each passing its own rows by every pair, so each thread's L2 holds
 * only its own slabs of x. Where the pair fits in L1, splitting the slabs would give up the L1
 * reuse above, so the pairs stay split; so they do with fewer than four slabs a thread, where
 * there are too few slabs to share the work evenly. */
static void gemm_slabs(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                       int64_t m, int64_t n, int64_t k, int fused) {
    const int64_t kblocks = k / 32, nblocks = n / 16, half = nblocks / 2;
    const int64_t groups = fused ? half : (nblocks + 1) / 2, pairs = fused ? 1 : 0;
    const int64_t slabs = (m + 31) / 32, run = kblocks * 1024;  /* run: bytes of one block's tiles */
    const int64_t rows_per_step = (MAX_ROWS + kblocks - 1) / kblocks;  /* the last slab's in one pass over k */
    const int split_slabs = 2 * run > L1_BYTES && slabs >= 4 * omp_get_max_threads();
    #pragma omp parallel
    {
        int64_t configured = 0;  /* the slab height the tiles are set up for */
        float out[MAX_ROWS * GROUP * 16];  /* rows 0-15, then 16-31 */
        struct epilogue last = {0};  /* the last slab's products, written during this slab's */
        /* This thread's groups [g0, g1) and slabs [s0, s1): a share of one, all of the other. */
        const int64_t tid = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t g0 = split_slabs ? 0 : groups * tid / threads;
        const int64_t g1 = split_slabs ? groups : groups * (tid + 1) / threads;
        const int64_t s0 = split_slabs ? slabs * tid / threads : 0;
        const int64_t s1 = split_slabs ? slabs * (tid + 1) / threads : slabs;
        const int64_t lines_per_step = s1 > s0 ? (32 + s1 - s0 - 1) / (s1 - s0) : 0;
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t b0 = fused ? g : g * 2, blocks = fused ? 2 : nblocks - b0 < 2 ? nblocks - b0 : 2;
            /* The next group's two blocks, prefetched in turn: `ahead` walks the first, then
             * the second (the plain product's follow each other, the fused one's lie half apart). */
            const int64_t next = g + 1 < g1 ? (fused ? g + 1 : b0 + 2) : -1;
            const int64_t next_blocks = next < 0 ? 0 : fused ? 2 : nblocks - next < 2 ? nblocks - next : 2;
            const char *runs[2] = {NULL, NULL};
            for (int64_t i = 0; i < next_blocks; ++i)
                runs[i] = (const char *)(packed + group_block(fused, next, 1, half, i) * kblocks * 512);
            const char *ahead = runs[0], *ahead_end = runs[0] ? runs[0] + run : NULL;
            int64_t ahead_run = 0;
            for (int64_t r0 = 32 * s0; r0 < m && r0 < 32 * s1; r0 += 32) {
                const int64_t rows = m - r0 < 32 ? m - r0 : 32;
                if (rows != configured) {
                    configure_tiles(rows > 16 ? 16 : rows, rows > 16 ? rows - 16 : 0);
                    configured = rows;
                }
                const uint16_t *slab = x + r0 * k;
                zero_accumulators();
                for (int64_t kb = 0; kb < kblocks; ++kb) {
                    for (int64_t i = 0; i < lines_per_step && ahead < ahead_end; ++i) {
                        _mm_prefetch(ahead, _MM_HINT_T1);
                        ahead += 64;
                        if (ahead == ahead_end && ++ahead_run < next_blocks) {
                            ahead = runs[ahead_run];
                            ahead_end = ahead + run;
                        }
                    }
                    /* x's tiles with the streaming hint: they pass through L1 once per pair
                     * and would evict the pair's W tiles, which every slab reuses. */
                    _tile_stream_loadd(4, slab + kb * 32, k * 2);
                    _tile_loadd(6, W_TILE(0), 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (blocks > 1) {
                        _tile_loadd(7, W_TILE(1), 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (rows > 16) {
                        _tile_stream_loadd(5, slab + 16 * k + kb * 32, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (blocks > 1) _tile_dpbf16ps(3, 5, 7);
                    }
                    epilogue_rows(&last, rows_per_step);
                }
                /* (the last slab's rows are all written by now: out is free) */
                _tile_stored(0, out, GROUP * 64);
                _tile_stored(1, out + 16, GROUP * 64);
                if (rows > 16) {
                    _tile_stored(2, out + 16 * GROUP * 16, GROUP * 64);
                    _tile_stored(3, out + 16 * GROUP * 16 + 16, GROUP * 64);
                }
                last = fused ? (struct epilogue){out, bias, y + r0 * (n / 2), rows, 0, n / 2, b0, 1, 1}
                             : (struct epilogue){out, bias, y + r0 * n, rows, 0, n, b0, blocks, 0};
            }
        }
        epilogue_rows(&last, MAX_ROWS);
        _tile_release();
    }
}

/* y = x @ W^T + bias (fused: silu(gate) * up of it), as tile_gemm_bf16 takes them. */
static void amx_gemm(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int fused) {
    if (m <= 16)
        gemm_16(x, packed, bias, y, m, n, k, fused);
    else
        gemm_slabs(x, packed, bias, y, m, n, k, fused);
}

#else

int tile_gemm_use_amx(int enable) { (void)enable; return 0; }

#endif
#endif
