"""What every benchmark in benchmarks/ shares; it is not a benchmark itself, and no benchmark imports another.

A script run as `python benchmarks/<name>.py` has benchmarks/ on its path, so it reaches these modules as
`from harness.<module> import ...`. Each module imports only what it needs at the top (torch, transformers, numpy),
and grpo_plus, TRL and PEFT inside its functions, so benchmarks/gpu.py still runs on a bare GPU machine with only
torch, transformers, PEFT, accelerate and the project's wheel.

  flags      the flags benchmarks share (--steps, --warmup, --repeats, --threads, --json, --smoke, --quick)
  report     the run's report: thread count and versions, the results JSON, the Markdown table beside it
  trainers   stock TRL's and grpo_plus's trainers built on the same work from the same seed, each timed and counted;
             the demo config (recipes/configs/demo_cpu.yaml) run in lock-step
  lockstep   one trainer at a time in its own thread, handing over after each optimizer step, each with its own
             random state
  timing     step timer, timed methods, generation's forwards timed, alternated repeats
  process    one measurement per fresh process (a JSON job in, a JSON result out) and the process's peak RSS
  shapes     Qwen2.5-shaped models with random weights, a word tokenizer and synthetic micro-batches

What the benchmarks share with the tests (tiny models, rewards, the forward-position counter, TRL's loss on a
stand-in trainer, one vLLM engine for several trainers) lives in grpo_plus.app.testing.
"""
