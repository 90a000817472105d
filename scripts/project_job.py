"""The flagship job projected from the measured rates recorded in BENCHMARKS.md (never typed by hand).

    python scripts/project_job.py [--gpus 8] [--no-record]

Job: ImageNet-1k (1,281,167 images), ViT-B/16 (197 tokens, d=768), 1 layer, 8 TopK SAEs (width
16 x d = 12,288, k=32, 1 epoch over the 95% training split: 196 patch tokens per image), held-out
eval (eval_tokens 1,000,000 per SAE), spliced eval (every held-out image: 5%), visuals (one pass
over the cache per SAE). Each stage's time = its amount of work / a rate read from a named section
of BENCHMARKS.md; the machine is the one that section names. Where no section measured a stage
on a machine, the row says so and the total is a lower bound. With ``--gpus N`` (N <= 8): one dump
job per shard range on each GPU, the 8 SAEs spread over the GPUs (8 / N per pass), eval and
visuals per SAE spread too; gather runs once. Section ``projection``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

N_IMGS = 1_281_167
PATCHES = 196  # the SAEs train on patch tokens
N_SAES, WIDTH = 8, 12_288
TRAIN_TOKENS = round(0.95 * N_IMGS) * PATCHES
EVAL_IMGS = -(-1_000_000 // PATCHES)  # eval_tokens per SAE
SPLICED_IMGS = round(0.05 * N_IMGS)


def sections(text: str) -> dict[str, str]:
    return {
        m.group(1): m.group(2) for m in re.finditer(r"<!-- bench:([\w-]+) -->\n(.*?)<!-- /bench:\1 -->", text, re.S)
    }


def tables(body: str) -> list[list[dict[str, str]]]:
    """The markdown tables of a section, each a list of rows {column: cell}."""
    out, cur, head = [], None, None
    for line in body.splitlines():
        if not line.startswith("|"):
            cur = head = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            head, cur = cells, []
            out.append(cur)
        elif not set("".join(cells)) <= set("-:"):
            cur.append(dict(zip(head, cells, strict=False)))
    return out


def num(cell: str) -> float:
    return float(cell.replace(",", ""))


def machine(body: str) -> str:
    m = re.search(r"- machine: vm: (\d+ cores)[^,]*,[^,]*?(?:, GPU ([^,]+))?,", body)
    return (m.group(2) or f"CPU, {m.group(1)}") if m else "?"


def row(tab: list[dict], **want) -> dict | None:
    return next((r for r in tab if all(r.get(k) == v for k, v in want.items())), None)


class Rates:
    """The stage rates of one machine kind (``cuda``: the -cuda sections) -> (seconds on 1 device,
    seconds on n devices, how, section) per stage, or None where not measured."""

    def __init__(self, secs: dict[str, str], cuda: bool, n: int):
        self.secs, self.cuda, self.n = secs, cuda, n
        self.sfx = "-cuda" if cuda else ""

    def sec(self, name: str) -> tuple[str, str] | None:
        name = name + self.sfx
        return (name, self.secs[name]) if name in self.secs else None

    def dump(self):
        s = self.sec("dump-true-size")
        if not s:
            return None
        r = row(tables(s[1])[0], **{"layers": "1", "cache.dtype": "float32"})
        rate = num(r["dump img/s"])
        return N_IMGS / rate, N_IMGS / rate / self.n, f"{rate:,.3g} images/s (dump, 1 layer, float32)", s

    def gather(self):
        s = ("scaling", self.secs["scaling"]) if "scaling" in self.secs else None
        if not s:
            return None
        t = num(row(tables(s[1])[0], scale="1x")["verify s"])
        return t, t, f"{t:.3g} s (verify of ImageNet's 106 shards: the same per-shard checks)", s

    def train(self):
        s = self.sec("train")
        if not s:
            return None
        tab = tables(s[1])[0]

        def tokens_s(per_pass: int) -> tuple[float, str] | None:
            got = [(num(r["tokens/s"]), r["variant"]) for r in tab
                   if r["SAEs per pass"] == str(per_pass) and r["variant"] in ("sparse-bf16", "hybrid-bf16")]  # fmt: skip
            return max(got) if got else None

        eight, one = tokens_s(8), tokens_s(1)
        if eight:  # tokens/s of a pass that trains all 8
            t1, how = TRAIN_TOKENS / eight[0], f"{eight[0]:,.3g} tokens/s, 8 SAEs per pass ({eight[1]})"
        else:  # one SAE per pass, eight passes
            t1, how = N_SAES * TRAIN_TOKENS / one[0], f"{one[0]:,.3g} tokens/s, 1 SAE per pass ({one[1]}), x8 passes"
        per_gpu = N_SAES // self.n
        got = tokens_s(per_gpu) if self.n > 1 else None
        tn = TRAIN_TOKENS / got[0] if got else t1 / self.n
        return t1, tn, how, s

    def heldout(self):
        s = self.sec("eval")
        if not s:
            return None
        r = tables(s[1])[0][0]
        rate = num(r["held-out images"]) / num(r["eval s"])
        t = N_SAES * EVAL_IMGS / rate
        return t, t / min(self.n, N_SAES), f"{rate:,.3g} images/s per SAE (width {r['width']})", s

    def spliced(self):
        s = self.sec("eval")
        if not s:
            return None
        r = row(tables(s[1])[1], layer="block 10 of 12")
        per = num(r["per SAE of 8 / plain"]) * num(r["plain s"]) / num(r["images"])
        t = N_SAES * SPLICED_IMGS * per
        return t, t / min(self.n, N_SAES), f"{1 / per:,.3g} images/s per SAE of 8 (block 10)", s

    def visuals(self):
        s = self.sec("visuals")
        if not s:
            return None
        tab = tables(s[1])[0]
        r = row(tab, width="6,144", **{"page cache": "cold"})
        n_img = int(re.search(r"\(([\d,]+) images", s[1]).group(1).replace(",", ""))
        rate = n_img / num(r["visuals s"])
        t = N_SAES * N_IMGS / rate
        return t, t / min(self.n, N_SAES), f"{rate:,.3g} images/s per SAE (width 6,144, cold)", s


def hours(t: float | None) -> str:
    return "not measured" if t is None else f"{t / 3600:,.2f} h" if t >= 360 else f"{t:,.0f} s"


def project(secs: dict[str, str], cuda: bool, n: int) -> tuple[list[dict], str]:
    r = Rates(secs, cuda, n)
    kind = "GPU" if cuda else "CPU"
    rows, tot1, totn, missing = [], 0.0, 0.0, []
    for stage, fn in [("dump", r.dump), ("gather", r.gather), ("train 8 SAEs", r.train),
                      ("held-out eval", r.heldout), ("spliced eval", r.spliced), ("visuals", r.visuals)]:  # fmt: skip
        got = fn()
        if got is None:
            missing.append(stage)
            rows.append({"on": kind, "stage": stage, "rate": "not measured on this machine", "section": "", "machine": "",
                         "1 device": "not measured", f"{n} devices": "not measured"})  # fmt: skip
            continue
        t1, tn, how, (name, body) = got
        tot1, totn = tot1 + t1, totn + tn
        rows.append({"on": kind, "stage": stage, "rate": how, "section": name, "machine": machine(body),
                     "1 device": hours(t1), f"{n} devices": hours(tn)})  # fmt: skip
    bound = "at least " if missing else ""
    rows.append({"on": kind, "stage": "total", "rate": f"missing: {', '.join(missing)}" if missing else "", "section": "",
                 "machine": "", "1 device": bound + hours(tot1), f"{n} devices": bound + hours(totn)})  # fmt: skip
    return rows, ", ".join(missing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8, help="devices of the second column (1..8)")
    ap.add_argument("--bench", default=benchlib.BENCH_MD)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.gpus <= N_SAES:
        sys.exit(f"--gpus {args.gpus}: use 1..{N_SAES}")
    with open(args.bench) as fh:
        secs = sections(fh.read())
    cpu, _ = project(secs, False, args.gpus)
    gpu, gpu_missing = project(secs, True, args.gpus)
    setup = [
        f"Job: ImageNet-1k ({N_IMGS:,} images), ViT-B/16 (197 tokens, d=768), 1 layer; 8 TopK SAEs (width "
        f"{WIDTH:,}, k=32), 1 epoch over the 95% training split ({TRAIN_TOKENS / 1e6:,.0f}M patch tokens); held-out "
        f"eval of {EVAL_IMGS:,} images per SAE (eval_tokens), spliced eval of {SPLICED_IMGS:,} (all held out), "
        "visuals: one pass over the cache per SAE.",
        "Each time = work / a rate read from the named section of this file (machine as that section names it); "
        f"{args.gpus} devices: one dump job per shard range on each, 8 / {args.gpus} SAEs per device, eval and "
        "visuals split by SAE, gather once.",
        "Recomputed by this script from the sections; rates measured at another size than the job's are named "
        "in the rate column (eval and visuals: width 6,144, half the job's).",
    ]
    notes = [
        "CPU rows: every stage measured on the 2-core VM; its dump rate is the ViT-B/16 forward's on 2 cores",
    ]
    if gpu_missing:
        notes.append(f"GPU rows: not yet measured on a GPU: {gpu_missing} (scripts/gpu_session.sh true-size "
                     "records dump-true-size-cuda); the total is a lower bound")  # fmt: skip
    body = benchlib.section_body(setup, [benchlib.table(cpu), benchlib.table(gpu)], notes)
    print(body)
    if not args.no_record:
        benchlib.record("projection", "The flagship job projected: ImageNet-1k, ViT-B/16, 1 layer, 8 SAEs (TopK, "
                        "width 16x, k=32, 1 epoch)", body)  # fmt: skip


if __name__ == "__main__":
    main()
