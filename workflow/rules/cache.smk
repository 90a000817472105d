# metadata -> dump (one job per shard range) -> gather (shards.json only after every shard is verified)


wildcard_constraints:
    hash=r"[0-9a-f]{64}",
    range=r"\d{6}-\d{6}",
    slot="|".join(MARK_SLOTS),


rule dump:
    """Run the ViT over the images of shards A..B-1 and write them (atomic, resumable). First it
    deletes the range's mark in the other slot: a stale claim that the range was complete."""
    output:
        mark=os.path.join(DUMP_TO, "{hash}", DUMP_MARKS_DIR, "{range}.{slot}"),
    params:
        actcache=ACTCACHE,
        experiment=lambda w: experiment_file(w.hash),
        shards=lambda w: "{}:{}".format(*(int(x) for x in w.range.split("-"))),
        dump_to=lambda w, output: os.path.dirname(os.path.dirname(os.path.dirname(output.mark))),
        stale=lambda w, output: other_mark(output.mark),
    log:
        "logs/dump/{hash}/{range}.{slot}.log",
    benchmark:
        "benchmarks/dump/{hash}/{range}.{slot}.tsv"
    threads: 4
    conda:
        "../envs/actcache.yaml"
    resources:
        gpu=1,
    shell:
        "rm -f {params.stale} && "
        "{params.actcache} dump --experiment {params.experiment} --shards {params.shards} "
        "--dump-to {params.dump_to} --workers {threads} --no-progress > {log} 2>&1 "
        "&& touch {output.mark}"


rule gather:
    """Verify every shard of a hash directory, then write its shards.json."""
    input:
        range_marks_of=lambda w: range_marks(w.hash),
    output:
        os.path.join(DUMP_TO, "{hash}", SHARDS_FILE),
    params:
        actcache=ACTCACHE,
    log:
        "logs/gather/{hash}.log",
    benchmark:
        "benchmarks/gather/{hash}.tsv"
    threads: 1
    conda:
        "../envs/actcache.yaml"
    shell:
        "{params.actcache} gather $(dirname {output}) > {log} 2>&1 && {params.actcache} verify $(dirname {output}) >> {log} 2>&1"
