# config/config.yaml checked by actcache first: a mistake (a mistyped key, an experiment listed
# twice, a wrong type) stops the parse with one line naming the file and the key, exit status 2,
# before Snakefile's schema check (which then only backs it up) would print its schema dump.
import sys

from actcache.errors import ActCacheError
from actcache.plan import checked_workflow_config
from actcache.preflight import Setting


def _fail(msg):
    # A config error is the user's to fix: one message naming the file and the key, no traceback.
    print(f"actcache: config error: {msg}", file=sys.stderr)
    sys.exit(2)


def config_source(key=None):
    """Where config[key] was written: `snakemake --config`, a `--configfile`, or config/config.yaml."""
    settings = workflow.config_settings
    if key is not None and key in (settings.config or {}):
        return "snakemake --config"
    return str(list(settings.configfiles)[-1]) if settings.configfiles else "config/config.yaml"


def config_setting(key):
    return Setting(config[key], config_source(key), key)


try:
    WORKFLOW_CONFIG = checked_workflow_config(config, config_source())
except ActCacheError as err:
    _fail(str(err))
config["experiments"] = list(WORKFLOW_CONFIG.experiments)  # as read: a single file becomes a list
