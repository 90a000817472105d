# metadata -> dump (one job per shard range) -> gather (shards.json only after every shard is verified)


wildcard_constraints:
    hash=r"[0-9a-f]{64}|[0-9a-f]{8}",  # a v1 cache hash (sha256), or a saev cache id (caches:)
    range=r"\d{6}-\d{6}",
    slot="|".join(MARK_SLOTS),


ruleorder: await_dump > dump
ruleorder: await_gather > gather


rule dump:
    """Run the ViT over the images of shards A..B-1 and write them (atomic, resumable). First it
    deletes the range's mark in the other slot (a stale claim that the range was complete) and,
    under Slurm, claims the range with its job id (see await_dump)."""
    output:
        mark=os.path.join(DUMP_TO, "{hash}", DUMP_MARKS_DIR, "{range}.{slot}"),
    params:
        actcache=ACTCACHE,
        experiment=lambda w: experiment_file(w.hash),
        shards=lambda w: "{}:{}".format(*(int(x) for x in w.range.split("-"))),
        dump_to=lambda w, output: os.path.dirname(os.path.dirname(os.path.dirname(output.mark))),
        stale=lambda w, output: other_mark(output.mark),
        claim=lambda w, output: mark_claim(output.mark),
    log:
        "logs/dump/{hash}/{range}.{slot}.log",
    benchmark:
        "benchmarks/dump/{hash}/{range}.{slot}.tsv"
    threads: 4
    conda:
        "../envs/actcache.yaml"
    resources:
        gpu=1,
        attempt=attempt,
    shell:
        "".join(
            (
                ATTEMPT_LOG,
                USER_ERROR,
                "rm -f {params.stale} && ",
                CLAIM,
                fail_fast(
                    f"{AS_TASK} {{params.actcache}} dump --experiment {{params.experiment}} --shards {{params.shards}} "
                    "--dump-to {params.dump_to} --workers {threads} --no-progress >> {log} 2>&1"
                ),
                " && touch {output.mark}",
            )
        )


rule await_dump:
    """A range whose dump job, submitted by an earlier snakemake that was killed, is still queued
    or running: wait for that job on the login node instead of submitting a second one. Fails
    (and the next run dumps the range again) when that job ends without writing the mark."""
    output:
        # update(): Snakemake must not delete the mark that the awaited job writes
        mark=update(os.path.join(DUMP_TO, "{hash}", DUMP_MARKS_DIR, "{range}.{slot}")),
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("dump", w.hash, w.range),
    log:
        "logs/dump/{hash}/{range}.{slot}.await.log",
    wildcard_constraints:
        hash=awaited("dump", DUMP_MARKS_DIR, "."),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        "{params.python} -m actcache.slurmjobs await {params.job} {output.mark} > {log} 2>&1"


rule gather:
    """Verify every shard of a hash directory, then write its shards.json."""
    input:
        range_marks_of=lambda w: range_marks(w.hash),
    output:
        os.path.join(DUMP_TO, "{hash}", SHARDS_FILE),
    params:
        actcache=ACTCACHE,
        claim=lambda w: gather_claim(w.hash),
    log:
        "logs/gather/{hash}.log",
    benchmark:
        "benchmarks/gather/{hash}.tsv"
    threads: 1
    conda:
        "../envs/actcache.yaml"
    resources:
        attempt=attempt,
    shell:
        "".join(
            (
                ATTEMPT_LOG,
                USER_ERROR,
                CLAIM,
                fail_fast(
                    "{params.actcache} gather $(dirname {output}) >> {log} 2>&1 && "
                    "{params.actcache} verify $(dirname {output}) >> {log} 2>&1"
                ),
            )
        )


rule await_gather:
    """A cache whose gather job, submitted by an earlier snakemake that was killed, is still queued
    or running: wait for it on the login node (see await_dump). Same input as rule gather."""
    input:
        range_marks_of=lambda w: range_marks(w.hash),
    output:
        update(os.path.join(DUMP_TO, "{hash}", SHARDS_FILE)),
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("gather", w.hash),
    log:
        "logs/gather/{hash}.await.log",
    wildcard_constraints:
        hash=awaited("gather"),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        "{params.python} -m actcache.slurmjobs await {params.job} {output} > {log} 2>&1"
