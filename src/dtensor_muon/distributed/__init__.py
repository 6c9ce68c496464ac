"""What touches torch.distributed or DTensor internals: :mod:`.layout` (placements → boxes), :mod:`.exchange`
(all_to_all), :mod:`.consensus` (what ranks must agree on), :mod:`.overlap` (FSDP2 pre-forward hooks) and
:mod:`.process_exit`."""
