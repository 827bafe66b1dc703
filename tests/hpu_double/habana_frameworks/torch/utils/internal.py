import os


def is_lazy() -> bool:
    """Lazy mode unless PT_HPU_LAZY_MODE=0, as on the real stack."""
    return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"
