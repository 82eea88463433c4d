"""What the kernel sources define, as the host needs it."""


def mask_mode(causal, mask):
    """The kernel instance of a block pair: interval (documents / windows), causal or full."""
    return "interval" if mask is not None else "causal" if causal else "full"
