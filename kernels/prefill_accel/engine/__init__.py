"""Engine-neutral policy that every engine adapter (overlay/<engine>/<version>/) calls into, once.

An adapter turns engine objects into the small views defined here and applies the decisions it gets
back; nothing in this package imports an engine, and nothing here calls back into one. Modules:
  banner   the startup line naming the prefill-accel series a patched engine carries
  startup  the startup checks (the --sparse-prefill-* flags and their help in each engine's words, a
           schedule that leaves the backend inert, kernels that cannot run here)
  layers   which attention layers may go sparse (LayerTraits in, the reason a layer stays dense out)
  warmup   compiling and tuning the kernels for an engine's shapes at startup, not in the first long prompt
  planner  the step planner the patched schedulers call (limits, decodes first, the latency target), the
           SRPF key and the prefill streak of decode protection
  network  torch.distributed's store on loopback when every rank runs on one machine
"""
