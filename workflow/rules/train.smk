# SAE sweeps on a finished cache: one job per group of SAEs that share one stream of batches.


rule train:
    """Train every not-yet-finished SAE of one group from one pass of the shuffled loader."""
    input:
        # ancient: a re-gathered cache (a lost shard dumped again, same data) does not retrain
        shards=ancient(os.path.join(DUMP_TO, "{hash}", "shards.json")),
    output:
        mark=os.path.join(RUNS_TO, "{hash}", "groups", "{group}.done"),
    params:
        actcache=ACTCACHE,
        experiment=lambda w: train_job(w.hash, w.group)[0],
        group=lambda w: train_job(w.hash, w.group)[1],
        dump_to=lambda w, input: os.path.dirname(os.path.dirname(input.shards)),
        runs_to=lambda w, output: os.path.dirname(os.path.dirname(os.path.dirname(output.mark))),
    log:
        "logs/train/{hash}/{group}.log",
    benchmark:
        "benchmarks/train/{hash}/{group}.tsv"
    threads: 4
    conda:
        "../envs/actcache.yaml"
    resources:
        gpu=1,
    shell:
        "{params.actcache} train --experiment {params.experiment} --group {params.group} "
        "--dump-to {params.dump_to} --runs-to {params.runs_to} > {log} 2>&1 && touch {output.mark}"
