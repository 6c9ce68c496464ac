"""The distributed step: :mod:`.step` (the engine: preflight → consensus → prepare → strategies → outcome →
commit), :mod:`.context` (what one step's strategies share), :mod:`.preflight` (the local checks and the one
flag all-reduce), :mod:`.pending`, :mod:`.metrics` and :mod:`.strategies` (one module per placement)."""
