"""The shuffled loader's plan (pure numpy): runs cut on huge-page boundaries, partial images,
what each run is charged, and the loader reading such runs through 2 MiB mappings."""

from __future__ import annotations

import numpy as np
import pytest

from actcache.loaders import ShuffledLoader
from actcache.loaders.plan import EpochPlan, Geometry, cut_points, cut_runs, epoch_runs, part_runs
from conftest import make_cache

# 2 stored layers of CLS + 4 patches, D=3 (12-byte vectors); the selection reads layer 1's patches
GEOM = Geometry(L=2, T=5, D=3, layer_idx=(1,), token_start=1, n_tokens=4, layers=(3, 7), cls=True)


def example_bytes(geom: Geometry, n_imgs: int):
    """[start, end) in the shard of every selected example, image-major (brute force)."""
    img = np.repeat(np.arange(n_imgs), geom.per_img)
    e = np.tile(np.arange(geom.per_img), n_imgs)
    row = geom.decode(img, e)[0]
    return row * geom.vec_bytes, (row + 1) * geom.vec_bytes


@pytest.mark.parametrize("unit", [16, 64, 100])
@pytest.mark.parametrize(
    "geom",
    [
        GEOM,
        Geometry(L=2, T=5, D=3, layer_idx=(0, 1), token_start=0, n_tokens=5, layers=(3, 7), cls=True),
        Geometry(L=1, T=7, D=2, layer_idx=(0,), token_start=1, n_tokens=6, layers=(5,), cls=True),
    ],
)
def test_cut_points_are_exactly_the_cuts_with_a_unit_boundary_between_the_examples(geom, unit):
    n = 9
    s, e = example_bytes(geom, n)
    want = []
    for k in range(1, n * geom.per_img):
        lo, hi = e[:k].max(), s[k:].min()  # a multiple of unit must lie in [lo, hi]
        if -(-lo // unit) * unit <= hi:
            want.append(k)
    np.testing.assert_array_equal(cut_points(geom, n, unit), want)


def test_cut_runs_cover_each_shard_once_and_cut_on_points_when_they_can():
    per, shard_imgs, run_imgs = GEOM.per_img, [40, 0, 13, 25], 6
    points = [cut_points(GEOM, n, 64) for n in shard_imgs]
    runs = cut_runs(shard_imgs, run_imgs, np.random.default_rng(5), per, points)
    assert runs.shape[1] == 5
    for shard, n in enumerate(shard_imgs):
        rs = runs[runs[:, 0] == shard]
        start = rs[:, 1] * per + rs[:, 3]  # shard-local example indices
        end = rs[:, 1] * per + rs[:, 4]
        if n == 0:
            continue
        np.testing.assert_array_equal(start[1:], end[:-1])  # contiguous, no gap, no overlap
        assert start[0] == 0 and end[-1] == n * per
        assert ((rs[:, 2] == -(-end // per) - rs[:, 1]) & (rs[:, 3] < per)).all()
        lengths = end - start
        assert (lengths[:-1] >= (run_imgs // 2) * per).all() and (lengths <= (run_imgs + run_imgs // 2) * per).all()
        cuts = end[:-1]
        assert np.isin(cuts, points[shard]).all()  # points come every few images here
    # without points: whole images, as before
    plain = cut_runs(shard_imgs, run_imgs, np.random.default_rng(5), per)
    assert (plain[:, 3] == 0).all() and (plain[:, 4] == plain[:, 2] * per).all()


def test_equal_runs_have_run_imgs_images_but_a_shards_last():
    per, shard_imgs, run_imgs = GEOM.per_img, [40, 0, 13, 25, 6], 6
    runs = cut_runs(shard_imgs, run_imgs, np.random.default_rng(5), per, equal=True)
    for shard, n in enumerate(shard_imgs):
        rs = runs[runs[:, 0] == shard]
        assert rs[:, 2].sum() == n and (rs[:, 3] == 0).all() and (rs[:, 4] == rs[:, 2] * per).all()
        if n:
            np.testing.assert_array_equal(rs[:-1, 2], run_imgs)  # whole images, one length
            assert rs[-1, 2] == n - (len(rs) - 1) * run_imgs and 0 < rs[-1, 2] <= run_imgs
    # the epoch order still comes from (seed, epoch): the same runs, shuffled
    a, b = (epoch_runs(shard_imgs, run_imgs, per, 3, e, equal=True) for e in (0, 1))
    assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, runs.tolist())) == sorted(map(tuple, b.tolist()))
    assert not np.array_equal(a, b)


def test_part_runs_narrow_runs_that_start_inside_an_image():
    per = 4
    runs = np.array([[0, 2, 3, 1, 10], [1, 0, 2, 0, 8], [0, 4, 2, 2, 6]], np.int64)  # 9 + 8 + 4 examples
    got = part_runs(runs, per, 5, 19)
    np.testing.assert_array_equal(got, [[0, 2, 3, 6, 10], [1, 0, 2, 0, 8], [0, 4, 2, 2, 4]])
    assert part_runs(runs, per, 3, 3).shape == (0, 5)


def test_huge_mode_runs_are_charged_the_blocks_they_map_and_share_none():
    shard_imgs, unit = [40, 13, 25], 64
    points = [cut_points(GEOM, n, unit) for n in shard_imgs]
    runs = cut_runs(shard_imgs, 6, np.random.default_rng(2), GEOM.per_img, points)
    runs = runs[np.random.default_rng(3).permutation(len(runs))]
    n_ex = int((runs[:, 4] - runs[:, 3]).sum())
    plan = EpochPlan(GEOM, runs, 0, 7, n_ex, 10**9, 1, np.random.default_rng(1), map_unit=unit)
    blocks: dict[int, set] = {}
    taken = []
    for spec in plan.batches():
        for r in spec.admit:
            s, e = r.extents(GEOM, [0])
            assert r.span == (int(s.min()), int(e.max()))  # first to last selected byte
            mine = set()
            for a, b in zip(s.tolist(), e.tolist(), strict=True):
                mine |= set(range(a // unit, -(-b // unit)))
            # charged: every block the run's mapping spans (first to last, like a merged range)
            assert int(r.strip_bytes.sum()) == (max(mine) - min(mine) + 1) * unit
            assert not (blocks.setdefault(r.shard, set()) & mine)  # cut on points: nothing shared
            blocks[r.shard] |= mine
        taken += [(r.shard, r.img0 * GEOM.per_img + int(v)) for r, x in spec.takes for v in x]
    assert len(taken) == len(set(taken)) == n_ex == sum(shard_imgs) * GEOM.per_img


def test_exact_extents_of_a_partial_run():
    geom = Geometry(L=2, T=5, D=3, layer_idx=(0, 1), token_start=1, n_tokens=4, layers=(3, 7), cls=True)
    assert geom.per_img == 8  # layer 0's patches, then layer 1's
    runs = np.array([[0, 1, 2, 3, 13]], np.int64)  # image 1 from example 3, image 2 up to example 5
    plan = EpochPlan(geom, runs, 0, 4, 10, 10**9, 1, np.random.default_rng(0))
    (spec,) = list(plan.batches())[:1]
    (r,) = spec.admit
    s, e = r.extents(geom, [0])
    vb = geom.vec_bytes
    got = sorted(zip((s // vb).tolist(), (e // vb).tolist(), strict=True))
    # image 1 (rows 10..19): layer 0 token 4 (example 3), layer 1 tokens 1-4; image 2 (rows
    # 20..29): layer 0 tokens 1-4, layer 1 token 1 (example 4)
    assert got == [(14, 15), (16, 20), (21, 25), (26, 27)]
    assert int(r.strip_bytes.sum()) == 10 * vb


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    # 1 layer of CLS + 62 patches, D=64: 16,128 bytes per image, so 2 MiB boundaries fall inside
    # images (runs then start and end with part of an image); ~39 MB in 4 shards
    return make_cache(tmp_path_factory.mktemp("big"), n_imgs=2400, layers=(4,), n_patches=62, d=64, imgs_per_shard=700)


@pytest.mark.parametrize("world_size", [1, 3])
def test_loader_through_huge_mappings_reads_runs_cut_on_2mib_boundaries(big, world_size):
    path, md, acts = big
    seen = []
    for rank in range(world_size):
        ld = ShuffledLoader(
            path,
            batch_size=1000,
            layer=4,
            seed=9,
            buffer_bytes=26 * 2**20,
            run_bytes=int(1.6 * 2**20),
            rank=rank,
            world_size=world_size,
        )
        ld.map_mode = "huge"  # forced: by default only runs of >= ~11 MiB are read this way
        per, n_cut = ld.geom.per_img, 0
        runs = [r for spec in ld.epoch_plan(0).batches() for r in spec.admit]
        for r in runs:  # a cut is on a 2 MiB boundary unless it is a shard's or a part's end
            pts = set(ld._cut_points()[r.shard].tolist())
            start, end = r.img0 * per + r.lo, r.img0 * per + r.hi
            assert start == 0 or start in pts or (r is runs[0] and rank > 0)
            assert end == ld.shard_imgs[r.shard] * per or end in pts or (r is runs[-1] and rank < world_size - 1)
            n_cut += start % per != 0
        assert n_cut > 0  # some runs start inside an image
        batches = []
        for b in ld:
            batches.append({k: v.numpy().copy() for k, v in b.items()})
        for b in batches:
            np.testing.assert_array_equal(b["act"], acts[b["image_i"], 0, b["patch_i"] + 1])
        seen += [(i, p) for b in batches for i, p in zip(b["image_i"], b["patch_i"], strict=True)]
        assert ld.stats.peak_held_bytes <= 26 * 2**20 + ld.read_ahead_bytes + 2 * 1000 * md.d_vit * 4
    assert len(seen) == len(set(seen)) == 2400 * 62


def test_private_arena_reads_parts_that_cut_images(big):
    # io="read" packs a run's examples into its slot; a part's end cuts an image, so the slot
    # then starts or ends with part of one
    path, md, acts = big
    seen = []
    for rank in range(7):
        ld = ShuffledLoader(
            path,
            batch_size=777,
            layer=4,
            seed=4,
            buffer_bytes=8 * 2**20,
            run_bytes=2**19,
            io="read",
            rank=rank,
            world_size=7,
        )
        assert any(
            (r.lo % ld.geom.per_img) or (r.hi % ld.geom.per_img)
            for spec in ld.epoch_plan(0).batches()
            for r in spec.admit
        )
        for b in ld:
            np.testing.assert_array_equal(b["act"].numpy(), acts[b["image_i"], 0, b["patch_i"] + 1])
            seen += list(zip(b["image_i"].tolist(), b["patch_i"].tolist(), strict=True))
    assert len(seen) == len(set(seen)) == 2400 * 62


def plan_entropy(plan: EpochPlan, per_img: int, n_imgs: int) -> tuple[float, np.ndarray]:
    """Mean normalised image-index entropy per batch (as the bench measures it), and the
    epoch's examples (global ids) in batch order."""
    H, seen = [], []
    for spec in plan.batches():
        ids = np.concatenate([(r.shard * 10**6 + r.img0) * per_img + x for r, x in spec.takes])
        assert len(ids) == spec.n
        seen.append(ids)
        _, c = np.unique(ids // per_img, return_counts=True)
        p = c / c.sum()
        H.append(-(p * np.log(p)).sum() / np.log(min(spec.n, n_imgs)))
    return float(np.mean(H)), np.concatenate(seen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_rate_plan_mixes_better_when_most_of_the_data_fits(seed, monkeypatch):
    """Buffer = 3/4 of the data (the bench's 3.2 GB over 4.3 GB): drawing the first third of
    the first fill twice as fast makes room mid-epoch for the rest, which then mixes with the
    other two thirds; equal shares per run leave an uneven tail (plan.py)."""
    # as in the bench: ~3 examples of each resident image per batch, ~85 batches an epoch
    geom = Geometry(L=1, T=200, D=1, layer_idx=(0,), token_start=0, n_tokens=200, layers=(5,), cls=False)
    shard_imgs = [175] * 4
    n_imgs, per = sum(shard_imgs), geom.per_img
    runs = epoch_runs(shard_imgs, 8, per, seed, 0)
    budget = 525 * geom.img_bytes

    def plan():
        return EpochPlan(geom, runs, 0, 1650, n_imgs * per, budget, 1, np.random.default_rng(seed))

    two, seen = plan_entropy(plan(), per, n_imgs)
    want = np.concatenate([(s * 10**6 + np.arange(n)) * per for s, n in enumerate(shard_imgs)])
    want = (want[:, None] + np.arange(per)).ravel()
    np.testing.assert_array_equal(np.sort(seen), np.sort(want))  # every example exactly once
    p = plan()
    first = next(p.batches())
    assert any(r.weight > 1.5 * (r.j1 - r.j0) for r in first.admit)  # the two-rate plan is on
    monkeypatch.setattr(EpochPlan, "LATE_MAX", 0.0)  # equal shares per run
    equal, seen = plan_entropy(plan(), per, n_imgs)
    np.testing.assert_array_equal(np.sort(seen), np.sort(want))
    assert two > equal + 0.003, (two, equal)


def test_a_part_that_fits_comes_in_over_the_first_batches():
    """Whole part within the budget: batch t draws only from the first 1/8, 3/8, 5/8 of it, so
    the first batch waits for an eighth of the reads, not all of them (plan.py, Ramp)."""
    geom = Geometry(L=1, T=200, D=1, layer_idx=(0,), token_start=0, n_tokens=200, layers=(5,), cls=False)
    shard_imgs = [60] * 4
    per = geom.per_img
    runs = epoch_runs(shard_imgs, 6, per, 3, 0)
    total = sum(int(r[2]) for r in runs) * geom.img_bytes
    plan = EpochPlan(geom, runs, 0, 2000, 240 * per, 10 * total, 1, np.random.default_rng(3))
    admitted, frac, seen = 0, [], []
    for spec in plan.batches():
        admitted += sum(r.n_imgs for r in spec.admit) * geom.img_bytes
        frac.append(admitted / total)
        seen.append(np.concatenate([(r.shard * 10**6 + r.img0) * per + x for r, x in spec.takes]))
    assert frac[0] <= 0.125 + 0.1 and frac[1] <= 0.375 + 0.1 and frac[2] <= 0.625 + 0.1 and frac[3] == 1
    assert frac[0] > 0.05 and frac[1] > frac[0] and frac[2] > frac[1]
    seen = np.concatenate(seen)
    want = np.concatenate([(s * 10**6 + np.arange(n)) * per for s, n in enumerate(shard_imgs)])
    np.testing.assert_array_equal(np.sort(seen), np.sort((want[:, None] + np.arange(per)).ravel()))


@pytest.mark.parametrize("n_strips", [1, 3])
@pytest.mark.parametrize("start", [0, 4])
def test_on_admit_passes_each_admitted_run_once_before_its_batch(n_strips, start):
    """The loader's readers start on a run as soon as the plan admits it (EpochPlan.batches'
    on_admit): every run of a yielded spec's ``admit`` is passed exactly once, for that batch,
    before the spec comes out, with no more bytes held than the spec says; the plan itself is
    the same with or without the callback, and each spec's arrays say what ``takes`` says."""
    shard_imgs = [40, 13, 25]
    runs = cut_runs(shard_imgs, 6, np.random.default_rng(2), GEOM.per_img)
    runs = runs[np.random.default_rng(3).permutation(len(runs))]
    n_ex = int((runs[:, 4] - runs[:, 3]).sum())

    def plan():
        return EpochPlan(GEOM, runs, 0, 37, n_ex, 20 * GEOM.img_bytes, n_strips, np.random.default_rng(1))

    passed: list = []
    got = []
    for spec in plan().batches(start, on_admit=lambda *a: passed.append(a)):
        mine = [(r, held) for r, t, held in passed if t == spec.index]
        key = lambda r: r.key  # noqa: E731 - (a resumed plan passes the runs it holds after the new ones)
        assert sorted((r for r, _ in mine), key=key) == sorted(spec.admit, key=key)  # all, before the spec
        assert len(mine) == len(spec.admit)
        assert all(held <= spec.plan_bytes for _, held in mine)
        assert all(t == spec.index for _, t, _ in passed)  # nothing passed for a later batch yet
        passed.clear()
        assert len(spec.runs) + 1 == len(spec.run_start) == len(spec.run_img0) + 1 == len(spec.run_shard) + 1
        assert spec.run_start[-1] == len(spec.x) == spec.n
        assert [r.img0 for r in spec.runs] == spec.run_img0.tolist()
        assert [r.shard for r in spec.runs] == spec.run_shard.tolist()
        got.append([(r.key, x.tolist()) for r, x in spec.takes])
    want = [[(r.key, x.tolist()) for r, x in spec.takes] for spec in plan().batches(start)]
    assert got == want and len(got) == -(-n_ex // 37) - start


def plan_digest(plan: EpochPlan, start: int = 0) -> str:
    """sha256 over everything a plan yields (and passes to on_admit), in order."""
    import hashlib

    h = hashlib.sha256()

    def put(*vals):
        for v in vals:
            h.update(np.ascontiguousarray(np.asarray(v, np.int64)).tobytes())

    def on_admit(r, t, held):
        put(r.key, [t, held, r.first_strip], r.strip_bytes, r.span or (-1, -1))

    for spec in plan.batches(start, on_admit=on_admit):
        put([spec.epoch, spec.index, spec.n, spec.plan_bytes], [r.key for r in spec.admit] or [-1])
        put([r.key for r in spec.runs] or [-1], spec.x, spec.run_start, spec.run_img0, spec.run_shard)
        put([(r.key[1], g) for r, g in spec.releases] or [-1])
        put([round(r.weight * 1000) for r in spec.admit] or [-1])
    return h.hexdigest()[:16]


def _pinned_plan(seed, n_strips, budget_imgs, batch, fixed=False, unit=0, ramp_fill=False):
    geom = Geometry(L=1, T=200, D=1, layer_idx=(0,), token_start=0, n_tokens=200, layers=(5,), cls=False)
    shard_imgs = [61, 47, 30, 52]
    points = [cut_points(geom, n, unit) for n in shard_imgs] if unit else None
    runs = epoch_runs(shard_imgs, 8, geom.per_img, seed, 0, points, equal=fixed)
    runs = part_runs(runs, geom.per_img, 100, sum(shard_imgs) * geom.per_img - 50)
    n_ex = int((runs[:, 4] - runs[:, 3]).sum())
    return EpochPlan(
        geom,
        runs,
        0,
        batch,
        n_ex,
        budget_imgs * geom.img_bytes,
        n_strips,
        np.random.default_rng([seed, 1]),
        fixed_run_bytes=8 * geom.img_bytes if fixed else None,
        map_unit=unit,
        ramp_fill=ramp_fill,
    )


PINNED_PLANS = [  # (plan arguments, start, digest of the batches computed before a refactor)
    (dict(seed=0, n_strips=1, budget_imgs=140, batch=1650), 0, "c7240103c2f7bfe7"),
    (dict(seed=1, n_strips=1, budget_imgs=60, batch=997), 0, "891eb0bae4ac6a0a"),
    (dict(seed=2, n_strips=1, budget_imgs=60, batch=997), 5, "4112cb8e279e8094"),
    (dict(seed=3, n_strips=3, budget_imgs=50, batch=1200), 0, "85c5321235a8204b"),
    (dict(seed=4, n_strips=3, budget_imgs=50, batch=1200), 7, "d2dc6e52482eaa6b"),
    (dict(seed=5, n_strips=1, budget_imgs=1000, batch=2000), 0, "456948606754495b"),
    (dict(seed=6, n_strips=1, budget_imgs=80, batch=1500, fixed=True, ramp_fill=True), 0, "3f2c6f42079b1ca2"),
    (dict(seed=7, n_strips=1, budget_imgs=90, batch=1500, unit=4096), 0, "811294f884542219"),
    (dict(seed=8, n_strips=1, budget_imgs=90, batch=1500, unit=4096), 3, "a98ea4dae925123d"),
]


@pytest.mark.parametrize("kw, start, digest", PINNED_PLANS)
def test_plans_are_bit_identical_to_the_pinned_ones(kw, start, digest):
    """The batches (and runs passed to on_admit) of fixed plans: a refactor of EpochPlan must
    not change a single example id, share, release or byte count."""
    assert plan_digest(_pinned_plan(**kw), start) == digest
