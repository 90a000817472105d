# SAE sweeps on a finished cache: one job per group of SAEs that share one stream of batches. The
# {group} wildcard is the group id (RunConfig.group_id) that `actcache plan` prints, that names
# the job and its log, and that `actcache train --group` takes.


wildcard_constraints:
    group=r"L[^/]+-[0-9a-f]{8}",


ruleorder: await_train > train


rule train:
    """Train every not-yet-finished SAE of one group from one pass of the shuffled loader. First it
    deletes the group's mark in the other slot: a stale claim that the group was complete. A
    cancelled job checkpoints (SIGTERM reaches `actcache train`) and its retry resumes."""
    input:
        # ancient: a re-gathered cache (a lost shard dumped again, same data) does not retrain
        shards=lambda w: ancient(cache_shards(w.hash)),
    output:
        mark=os.path.join(RUNS_TO, "{hash}", GROUPS_DIR, "{group}.{slot}"),
    params:
        commands=lambda w, output: train_commands(
            w.hash, w.group, os.path.dirname(os.path.dirname(os.path.dirname(output.mark)))
        ),
        stale=lambda w, output: other_mark(output.mark),
        claim=lambda w, output: mark_claim(output.mark),
    log:
        "logs/train/{hash}/{group}.{slot}.log",
    benchmark:
        "benchmarks/train/{hash}/{group}.{slot}.tsv"
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
                fail_fast("( {params.commands} ) >> {log} 2>&1"),
                " && touch {output.mark}",
            )
        )


rule await_train:
    """A group whose training job, submitted by an earlier snakemake that was killed, is still
    queued or running: wait for that job on the login node instead of submitting a second one
    (two trainers of one group would duplicate the compute and interleave its metrics). Fails,
    and the next run trains the group (resuming from its checkpoint), when that job ends without
    writing the mark. Same input as rule train, so the next run finds nothing changed."""
    input:
        shards=lambda w: ancient(cache_shards(w.hash)),
    output:
        # update(): Snakemake must not delete the mark that the awaited job writes
        mark=update(os.path.join(RUNS_TO, "{hash}", GROUPS_DIR, "{group}.{slot}")),
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("train", w.hash, w.group),
    log:
        "logs/train/{hash}/{group}.{slot}.await.log",
    wildcard_constraints:
        hash=awaited("train", GROUPS_DIR, "."),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        "{params.python} -m actcache.slurmjobs await {params.job} {output.mark} > {log} 2>&1"
