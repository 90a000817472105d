"""JumpReLU at matched L0 against SAELens, and actcache's L0 against l0_coeff, on bench_quality's data.

    python scripts/bench_jumprelu.py run --lib actcache --coeffs 1e-3,1e-2,1e-1 --seeds 0 [--d 64] [--regime short]
    python scripts/bench_jumprelu.py run --lib saelens --coeffs 0.3 --seeds 0,1,2
    python scripts/bench_jumprelu.py render        # the table from the collected rows -> BENCHMARKS.md

Data, trainers and metrics are scripts/bench_quality.py's (its seeded ground-truth dictionary,
identical in-memory batches, held-out FVU, recovery of the true directions, dead fraction, L0).
``run`` trains one (library, coefficient, seed) at a time and appends a JSON line to ``--results``,
so several processes can fill one file; ``render`` takes, per (d, regime, library), the
coefficient whose mean held-out L0 over seeds is nearest k = 8, and records the section
``quality-jumprelu`` (the JumpReLU cells of bench_quality, with the whole l0_coeff sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_quality as bq  # noqa: E402
import benchlib  # noqa: E402
import torch  # noqa: E402

DEFAULT_RESULTS = os.path.join(benchlib.ROOT, "bench-jumprelu.jsonl")


def run(args) -> None:
    torch.set_num_threads(args.threads)
    for seed in map(int, args.seeds.split(",")):
        data = bq.Data(args.d, seed)
        x_ND = data.batch(-1, bq.N_HELDOUT)
        for coeff in map(float, args.coeffs.split(",")):
            cell = bq.Cell("jumprelu", args.d, args.regime, coeff)
            trainer = bq.make_trainer(args.lib, cell, seed, "auto")
            t0 = time.perf_counter()
            for b in range(cell.steps):
                trainer.step(data.batch(b))
            row = {"lib": args.lib, "d": args.d, "regime": args.regime, "steps": cell.steps, "seed": seed,
                   "coeff": coeff, **bq.metrics(trainer, data, x_ND), "train_s": time.perf_counter() - t0}  # fmt: skip
            print(json.dumps(row), flush=True)
            with open(args.results, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def _means(rows: list[dict]) -> list[dict]:
    """One row per (d, regime, lib, coeff): means over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["d"], r["regime"], r["lib"], r["coeff"]), []).append(r)
    out = []
    for (d, regime, lib, coeff), rs in sorted(groups.items()):
        m = {k: statistics.mean(r[k] for r in rs) for k in ("fvu", "recovery", "dead", "l0")}
        spread = max(r["fvu"] for r in rs) - min(r["fvu"] for r in rs)
        out.append({"d": d, "regime": regime, "lib": lib, "coeff": coeff, "seeds": len(rs), **m, "fvu_spread": spread})
    return out


def render(args) -> None:
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    means = _means(rows)
    sweep = [{"d": m["d"], "regime": m["regime"], "library": m["lib"], "coefficient": m["coeff"], "seeds": m["seeds"],
              "L0": m["l0"], "FVU": m["fvu"], "FVU spread": m["fvu_spread"], "recovery": m["recovery"],
              "dead %": 100 * m["dead"]} for m in means]  # fmt: skip
    matched, conclusions = [], []
    for d, regime in sorted({(m["d"], m["regime"]) for m in means}):
        best = {}
        for lib in ("actcache", "saelens"):
            cands = [
                m for m in means if (m["d"], m["regime"], m["lib"]) == (d, regime, lib) and m["seeds"] >= args.min_seeds
            ]
            if cands:
                best[lib] = min(cands, key=lambda m: abs(m["l0"] - bq.K_TRUE))
        if len(best) == 2:
            a, s = best["actcache"], best["saelens"]
            peer = [m for m in means if (m["d"], m["regime"], m["lib"]) == (d, regime, "saelens")]
            at = bq.fvu_at_l0(peer, a["l0"])  # as bench_quality.py judges it
            ref = s["fvu"] if at is None else at
            ratio = a["fvu"] / ref
            matched.append({"cell": f"d={d} {regime}", "seeds": f"{a['seeds']} / {s['seeds']}",
                            "actcache l0_coeff": a["coeff"], "L0": a["l0"], "FVU": a["fvu"],
                            "SAELens l0_coefficient": s["coeff"], "SAELens L0": s["l0"], "SAELens FVU": s["fvu"],
                            "SAELens FVU at actcache's L0": "-" if at is None else at, "FVU ratio": ratio})  # fmt: skip
            where = f"{s['fvu']:.3f} at L0 {s['l0']:.2f}" if at is None else f"{at:.3f} interpolated to that L0"
            conclusions.append(f"d={d}, {regime}: actcache FVU {a['fvu']:.3f} at L0 {a['l0']:.2f} against SAELens "
                               f"{where} ({ratio:.3f} x; target <= 1.05 x)")  # fmt: skip
    setup = [
        "Data, trainers, metrics: scripts/bench_quality.py (d=64 or 256, 8 d true directions with Zipf 0.8 frequencies, "
        "U[0.5, 1.5] magnitudes, mean offset of norm 2, noise 1% of the variance; width 8 d; batch 4096; Adam lr "
        "2e-3; held-out 16,384 examples); JumpReLU at each library's defaults apart from lr, width and the "
        "swept coefficient.",
        "actcache: l0_coeff in fractions of the batch variance per latent; SAELens 6.54.12: l0_coefficient "
        "against the MSE summed over dimensions. L0, FVU, recovery, dead: held-out means over the seeds "
        "(dead: latents that never fire on the held-out 16,384; FVU spread: max - min over seeds).",
        f"Matched L0: per (d, regime, library) the coefficient whose mean L0 is nearest k = {bq.K_TRUE}, among "
        f"those run with at least {args.min_seeds} seeds; SAELens's FVU is interpolated (linear in L0) to "
        "actcache's L0 between its two coefficients that bracket it, else taken at its own point (bench_quality.py's "
        "verdict); seeds: actcache / SAELens.",
    ]
    tables = [benchlib.table(matched)] if matched else []
    tables.append(benchlib.table(sweep))
    conclusions += args.note
    body = benchlib.section_body(setup, tables, conclusions[: benchlib.MAX_CONCLUSIONS])
    print(body)
    if not args.no_record:
        benchlib.record(
            "quality-jumprelu",
            "JumpReLU at matched L0 against SAELens, and L0 against l0_coeff",
            body,
            when=os.path.getmtime(args.results),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--lib", choices=("actcache", "saelens"), default="actcache")
    r.add_argument("--coeffs", required=True, help="the library's sparsity coefficients, e.g. 1e-3,1e-2")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--d", type=int, default=64)
    r.add_argument("--regime", default="short", choices=tuple(bq.REGIMES))
    r.add_argument("--threads", type=int, default=1)
    g = sub.add_parser("render")
    g.add_argument("--min-seeds", type=int, default=3)
    g.add_argument("--note", action="append", default=[], help="a conclusion bullet to add")
    g.add_argument("--no-record", action="store_true")
    for p in (r, g):
        p.add_argument("--results", default=DEFAULT_RESULTS, help="JSON lines, one per trained SAE")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else render(args)


if __name__ == "__main__":
    main()
