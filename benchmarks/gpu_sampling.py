"""Is an engine's speculative decoding lossless at T > 0? Many sampled completions of a few
prompts per engine mode (GPU), then chi-square tests of their token distributions (CPU).

`run` starts one engine (the options of `gpu_engines.py`: plain, DFLASH, our DFLASH_TREE, ...)
and samples --samples completions of --max-tokens tokens for each of the first --num-prompts
dev prompts (temperature --temperature, top-p 1, EOS ignored, no per-request seed: SGLang
honours seeds only in deterministic mode), --concurrency requests in flight. `compare A B`
tests, per prompt and position, whether the token's distribution is the same in both runs
(`bench.sampling_stats`: chi-square homogeneity, Bonferroni at --alpha); run it against a plain
run for the verdict and plain against plain for the test's own false-positive rate (the second
plain run with another --seed: runs that share a seed and a request order can replay the same
random numbers, and `compare` exits 2 when two runs agree in order more often than chance).

    python benchmarks/gpu_sampling.py run --engine sglang --mode plain --out /tmp/s/plain.json
    python benchmarks/gpu_sampling.py run --engine sglang --mode tree --num-spec-tokens 32 \
        --attention-backend fa3 --out /tmp/s/tree.json
    python benchmarks/gpu_sampling.py compare /tmp/s/tree.json /tmp/s/plain.json   # CPU
    python benchmarks/gpu_sampling.py calibrate /tmp/s/plain.json   # CPU: false positives
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import checkout_first

checkout_first()  # this checkout's dflash_plugin (bench.engine_rows imports it)

from bench.engine_cli import (  # noqa: E402
    draft_of,
    engine_spec,
    header,
    prompt_ids,
    prompt_run_args,
    write,
)
from bench.engine_report import parse_tp_args  # noqa: E402
from bench.engine_rows import Sampling, start_engine, tau_of  # noqa: E402
from bench.sampling_stats import (  # noqa: E402
    coincidences,
    homogeneity_tests,
    split_calibration,
    verdict,
)


def cmd_run(args) -> None:
    ids = prompt_ids(args)
    t0 = time.perf_counter()
    runner = start_engine(engine_spec(args, args.target, draft_of(args),
                                      max_seqs=args.concurrency))
    doc = header(args, runner, "engine-sampling")
    doc.update(target=args.target, draft=draft_of(args),
               temperature=args.temperature, max_tokens=args.max_tokens,
               samples=args.samples, seed=args.seed, startup_s=time.perf_counter() - t0, prompts={})
    reqs = [p for p in ids for _ in range(args.samples)]  # [prompts x samples]
    sampling = Sampling(args.temperature, args.max_tokens, None)
    runner.run(reqs[: args.concurrency], [Sampling(args.temperature, 4, None)] *
               args.concurrency, args.concurrency)  # warm-up
    before = runner.counters()
    t0 = time.perf_counter()
    dones = runner.run(reqs, [sampling] * len(reqs), args.concurrency)
    doc["wall_s"] = time.perf_counter() - t0
    doc.update(tau_of(before, runner.counters(), dones))
    for i in range(len(ids)):
        doc["prompts"][str(i)] = [d.token_ids for d in
                                  dones[i * args.samples:(i + 1) * args.samples]]
    write(doc, args.out)
    print(f"{args.engine} {args.mode} T={args.temperature:g}: {len(reqs)} completions in "
          f"{doc['wall_s']:.1f} s, tau {doc.get('tau')}", flush=True)
    runner.close()


def cmd_compare(args) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    for key in ("temperature", "max_tokens", "target"):
        if a.get(key) != b.get(key):
            sys.exit(f"the runs differ in {key}: {a.get(key)!r} vs {b.get(key)!r}")
    positions = list(range(min(a["max_tokens"], b["max_tokens"])))
    tests = homogeneity_tests(a["prompts"], b["prompts"], positions, args.min_count)
    v = verdict(tests, args.alpha)
    same = coincidences(a["prompts"], b["prompts"], args.alpha)
    doc = {"a": args.a, "b": args.b, "mode_a": a.get("mode"), "mode_b": b.get("mode"),
           "tau_a": a.get("tau"), "tau_b": b.get("tau"), **v, "coincidences": same,
           "all": tests}
    if args.out:
        write(doc, args.out)
    w = v["worst"]
    print(f"{a.get('mode')} vs {b.get('mode')}: {v['tests']} tests, smallest p {v['min_p']:.3g} "
          f"(prompt {w['prompt']}, position {w['position']}, {w['columns']} columns) against "
          f"{v['threshold']:.3g}: {'same distribution' if v['passed'] else 'DIFFERENT'}")
    if not same["independent"]:
        worst = min(same["prompts"], key=lambda r: r["p"])
        print(f"NOT INDEPENDENT: prompt {worst['prompt']}: {worst['equal_in_order']} completions "
              f"equal in order against {worst['expected']:.0f} by chance; the tests above "
              "assume independent runs (start the second engine with another --seed)")
        sys.exit(2)
    if not v["passed"]:
        sys.exit(1)


def cmd_calibrate(args) -> None:
    run = json.loads(Path(args.run).read_text())
    doc = {"run": args.run, "mode": run.get("mode"),
           **split_calibration(run["prompts"], list(range(run["max_tokens"])), args.splits,
                               args.alpha, args.min_count)}
    if args.out:
        write(doc, args.out)
    print(f"{doc['mode']}: {doc['failed']} of {doc['splits']} random halvings fail at "
          f"family-wise {doc['alpha']:g} ({doc['tests']} tests each); median smallest p "
          f"{doc['median_min_p']:.3g} (uniform p-values: {doc['median_min_p_uniform']:.3g})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="sample completions with one engine configuration",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prompt_run_args(r, num_prompts=4, max_tokens=6)
    r.add_argument("--samples", type=int, default=2000, help="completions per prompt")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--concurrency", type=int, default=32)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="chi-square tests of two runs' token distributions")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--alpha", type=float, default=0.01, help="family-wise (Bonferroni)")
    c.add_argument("--min-count", type=int, default=10,
                   help="tokens drawn fewer times in both runs together are pooled")
    c.add_argument("--out", default=None, help="JSON with every test")
    c.set_defaults(func=cmd_compare)
    k = sub.add_parser("calibrate", help="false-positive rate: random halves of one run tested "
                       "against each other", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    k.add_argument("run")
    k.add_argument("--splits", type=int, default=100)
    k.add_argument("--alpha", type=float, default=0.01, help="family-wise (Bonferroni)")
    k.add_argument("--min-count", type=int, default=10)
    k.add_argument("--out", default=None)
    k.set_defaults(func=cmd_calibrate)
    args = parse_tp_args(p, argv)
    if args.command == "run" and not args.temperature > 0:
        p.error(f"--temperature must be > 0 (greedy runs: gpu_engines.py), got {args.temperature}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
