"""Entry point for torch's backend autoload (``torch.distributed.backends`` group, torch >= 2.14):
torch calls this with no arguments and expects the backend to be registered afterwards."""


def autoload() -> None:
    import xccl_rs  # noqa: F401  (importing registers the backend)
