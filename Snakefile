# actcache workflow: experiment YAML -> <dump_to>/<HASH>/ -> one dump job per shard range -> gather -> train.
#   snakemake --profile profiles/osc      # on the cluster (Slurm)
#   snakemake --profile profiles/local    # on one machine
#   snakemake -n --profile profiles/...   # dry run: which hashes still need computing
#   snakemake --report report.zip         # after a run: plots and latent pages of every SAE
from snakemake.utils import validate


configfile: "config/config.yaml"


# actcache's own one-line messages for config.yaml's mistakes come first; the schema backs them up.
include: "workflow/rules/config.smk"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        all_targets(),
        report_targets(),
    default_target: True
