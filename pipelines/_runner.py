"""The local runner both Beam jobs default to."""


def with_default_runner(beam_args: list[str]) -> list[str]:
    """``beam_args`` with ``--runner=FnApiRunner`` added when no runner is given: Beam 2.77's
    default DirectRunner first tries to download the Prism runner on every run."""
    if any(a == "--runner" or a.startswith("--runner=") for a in beam_args):
        return beam_args
    return ["--runner=FnApiRunner", *beam_args]
