# SAE sweeps on a finished cache: one job per group of SAEs that share one stream of batches. The
# {group} wildcard is the group id (RunConfig.group_id) that `actcache plan` prints, that names
# the job and its log, and that `actcache train --group` takes.


wildcard_constraints:
    group=r"L[^/]+-[0-9a-f]{8}",


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
                fail_fast("( {params.commands} ) >> {log} 2>&1"),
                " && touch {output.mark}",
            )
        )
