from habana_frameworks.recorder import RECORDER


def mark_step() -> None:
    """Ends the lazy-mode graph being built."""
    RECORDER.mark_step()
