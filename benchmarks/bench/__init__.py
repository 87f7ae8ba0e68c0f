"""The one helper package of the benchmark entry points (`python benchmarks/NAME.py` puts
`benchmarks/` on `sys.path`, so they import it as `bench`):
`common` (paths, fixtures, prompts, run record, JSON, timing, `attempt`, `agreement`,
`checkout_first`), `fast_rows` (timed passes, adaptive and cold rows of our fast runtime),
`tree_rows` (tree rounds), `projection` (graph-timed steps, Qwen3-8B-shape projection), `plot`
(the report of `gpu_speedup.py`), `engine_rows` (vLLM / SGLang back-ends of `gpu_engines.py` and
`gpu_dllm.py`), `engine_report` (their reports, the TP identity of two runs), `specfold`
(forced gate and 8B-shape model of the SpecFold benchmarks), `speedup_rows` / `reference_rows`
(the other row groups of `gpu_speedup.py`), `specfold_fast` / `specfold_batch` (timing core and
section `batch` of `specfold_fast_bench.py`).
"""
