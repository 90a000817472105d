# Plots and HTML pages of trained SAEs (`actcache visuals`), marked for `snakemake --report`:
# per SAE its visuals folder and its page in one small file (thumbnails inlined, under the 2 MiB a
# browser allows an embedded page: actcache.visuals_report), per cache the sweep plots over every
# SAE (file names: actcache.rundir). `snakemake --report report.html` (or report.zip) collects the
# one-file pages and the plots.


ruleorder: await_report > report
ruleorder: await_spliced_eval > spliced_eval
ruleorder: await_sweep_report > sweep_report


rule trained:
    """An SAE's done file, written by its group's train job: checked, never deleted (update).
    ancient: a group mark that moves (another member trained) makes no page stale."""
    input:
        mark=lambda w: ancient(visuals_group_mark(w.hash, w.sae)),
    output:
        done=update(os.path.join(RUNS_TO, "{hash}", "{sae}", DONE_FILE)),
    log:
        "logs/trained/{hash}/{sae}.log",
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        "test -f {output.done} > {log} 2>&1"


rule evaluated:
    """An SAE's eval.json, written by its group's train job and again by `actcache eval`: checked,
    never deleted (update). Its page depends on it, so a page is stale once its SAE is evaluated
    again; ancient: a rerun of `trained` (its group's mark moved) leaves it alone."""
    input:
        done=lambda w: ancient(sae_done(w.hash, w.sae)),
    output:
        evaluation=update(os.path.join(RUNS_TO, "{hash}", "{sae}", EVAL_FILE)),
    log:
        "logs/evaluated/{hash}/{sae}.log",
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        "test -f {output.evaluation} > {log} 2>&1"


rule report:
    """One pass over the cache per trained SAE: top images per latent, frequencies, histograms,
    training curves, and the HTML page."""
    input:
        done=lambda w: ancient(sae_done(w.hash, w.sae)),
        # after the spliced evaluation (ancient: its mark moves whenever any SAE of the cache is
        # evaluated); the SAE's own eval.json says when this page is stale (`actcache eval` of it)
        spliced=lambda w: [ancient(m) for m in [spliced_mark(w.hash)] if m],
        evaluation=lambda w: sae_eval(w.hash, w.sae),
    output:
        visuals=directory(os.path.join(RUNS_TO, "{hash}", "{sae}", VISUALS_DIR)),
        page=report(
            os.path.join(RUNS_TO, "{hash}", "{sae}", VISUALS_PAGE),
            caption="../report/visuals.rst",
            category="SAE latents",
            subcategory="{hash}",
            labels=lambda w: {"SAE": w.sae, "what": sae_title(w.hash, w.sae), "cache": w.hash},
        ),
    params:
        actcache=ACTCACHE,
        run_dir=lambda w, output: os.path.dirname(output.visuals),
        images=lambda w: "" if has_images(w.hash) else "--no-images",
        claim=lambda w: report_claim(w.hash, w.sae),
    log:
        "logs/report/{hash}/{sae}.log",
    benchmark:
        "benchmarks/report/{hash}/{sae}.tsv"
    threads: 4
    conda:
        "../envs/actcache.yaml"
    resources:
        gpu=1,
        attempt=attempt,
    shell:
        "".join((ATTEMPT_LOG, CLAIM, AS_TASK, " {params.actcache} visuals {params.images} {params.run_dir} >> {log} 2>&1"))


rule spliced_eval:
    """Spliced-in downstream metrics of every SAE of one cache (`actcache eval`): the ViT runs on
    the held-out images with each SAE's reconstruction in place of its layer's tokens; the results
    go into each SAE's eval.json. One job per cache: the ViT and the clean pass are shared."""
    input:
        marks=lambda w: sweep_group_marks(w.hash),
    output:
        mark=os.path.join(RUNS_TO, "{hash}", GROUPS_DIR, SPLICED_MARK),
    params:
        actcache=ACTCACHE,
        run_dirs=lambda w: " ".join(sweep_run_dirs(w.hash)),
        claim=lambda w: spliced_claim(w.hash),
    log:
        "logs/eval/{hash}/spliced.log",
    benchmark:
        "benchmarks/eval/{hash}/spliced.tsv"
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
                CLAIM,
                AS_TASK,
                " {params.actcache} eval --missing {params.run_dirs} >> {log} 2>&1 && touch {output.mark}",
            )
        )


rule sweep_report:
    """Held-out NMSE against L0, one point per SAE, every SAE's training curves, and the Pareto
    frontiers (L0 against FVU, spliced fraction recovered, label-probe accuracy)."""
    input:
        marks=lambda w: sweep_group_marks(w.hash),
        spliced=lambda w: spliced_mark(w.hash),
    output:
        nmse_l0=report(
            os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, NMSE_L0_PLOT),
            caption="../report/sweep.rst",
            category="SAE sweeps",
            labels={"cache": "{hash}", "plot": "NMSE against L0"},
        ),
        curves=report(
            os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, CURVES_PLOT),
            caption="../report/curves.rst",
            category="SAE sweeps",
            labels={"cache": "{hash}", "plot": "training curves"},
        ),
        pareto_fvu=report(
            os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, PARETO_FVU_PLOT),
            caption="../report/pareto_fvu.rst",
            category="SAE sweeps",
            labels={"cache": "{hash}", "plot": "Pareto: L0 against FVU"},
        ),
        pareto_spliced=report(
            os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, PARETO_SPLICED_PLOT),
            caption="../report/pareto_spliced.rst",
            category="SAE sweeps",
            labels={"cache": "{hash}", "plot": "Pareto: L0 against spliced fraction recovered"},
        ),
        pareto_probe=report(
            os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, PARETO_PROBE_PLOT),
            caption="../report/pareto_probe.rst",
            category="SAE sweeps",
            labels={"cache": "{hash}", "plot": "Pareto: L0 against label-probe accuracy"},
        ),
    params:
        actcache=ACTCACHE,
        run_dirs=lambda w: " ".join(sweep_run_dirs(w.hash)),
        out=lambda w, output: os.path.dirname(output.nmse_l0),
        claim=lambda w: sweep_claim(w.hash),
    log:
        "logs/report/{hash}/sweep.log",
    benchmark:
        "benchmarks/report/{hash}/sweep.tsv"
    threads: 1
    conda:
        "../envs/actcache.yaml"
    resources:
        attempt=attempt,
    shell:
        "".join(
            (
                ATTEMPT_LOG,
                CLAIM,
                "{params.actcache} visuals --plots-only --out {params.out} {params.run_dirs} >> {log} 2>&1",
            )
        )


# A report, spliced_eval or sweep_report job that an earlier, killed snakemake submitted and that
# is still queued or running is awaited on the login node, not submitted again (common.smk's
# in-flight block). Same inputs as the rule they stand for, so the next run finds nothing changed;
# update(): Snakemake must not delete what the awaited job writes.
AWAIT = "{params.python} -m actcache.slurmjobs await {params.job} {params.until} > {log} 2>&1"


rule await_report:
    input:
        done=lambda w: ancient(sae_done(w.hash, w.sae)),
        spliced=lambda w: [ancient(m) for m in [spliced_mark(w.hash)] if m],
        evaluation=lambda w: sae_eval(w.hash, w.sae),
    output:
        visuals=update(directory(os.path.join(RUNS_TO, "{hash}", "{sae}", VISUALS_DIR))),
        page=update(os.path.join(RUNS_TO, "{hash}", "{sae}", VISUALS_PAGE)),
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("report", w.hash, w.sae),
        until=lambda w, output: output.page,
    log:
        "logs/report/{hash}/{sae}.await.log",
    wildcard_constraints:
        hash=awaited("report", then=os.sep),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        AWAIT


rule await_spliced_eval:
    input:
        marks=lambda w: sweep_group_marks(w.hash),
    output:
        mark=update(os.path.join(RUNS_TO, "{hash}", GROUPS_DIR, SPLICED_MARK)),
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("spliced_eval", w.hash),
        until=lambda w, output: output.mark,
    log:
        "logs/eval/{hash}/spliced.await.log",
    wildcard_constraints:
        hash=awaited("spliced_eval"),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        AWAIT


rule await_sweep_report:
    input:
        marks=lambda w: sweep_group_marks(w.hash),
        spliced=lambda w: spliced_mark(w.hash),
    output:
        **{
            name: update(os.path.join(RUNS_TO, "{hash}", VISUALS_DIR, plot))
            for name, plot in (
                ("nmse_l0", NMSE_L0_PLOT),
                ("curves", CURVES_PLOT),
                ("pareto_fvu", PARETO_FVU_PLOT),
                ("pareto_spliced", PARETO_SPLICED_PLOT),
                ("pareto_probe", PARETO_PROBE_PLOT),
            )
        },
    params:
        python=sys.executable,
        job=lambda w: in_flight_job("sweep_report", w.hash),
        until=lambda w, output: output.nmse_l0,
    log:
        "logs/report/{hash}/sweep.await.log",
    wildcard_constraints:
        hash=awaited("sweep_report"),
    localrule: True
    conda:
        "../envs/actcache.yaml"
    shell:
        AWAIT
