"""Matrix functions: Newton–Schulz (:mod:`.newton_schulz`, its Gram form :mod:`.gram`, over a tensor-parallel
group :mod:`.distributed_ns`, replayed from CUDA graphs :mod:`.ns_graphs`) and SOAP's eigenbasis refresh
(:mod:`.eigenbasis`)."""
