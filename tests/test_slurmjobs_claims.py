"""Which workflow jobs a live Slurm job is already doing (actcache.slurmjobs.in_flight): claim
files on disk against this user's live jobs (id -> the comment the Slurm plugin set)."""

from __future__ import annotations

from actcache.slurmjobs import Claim, InFlight, claim_path, in_flight, plugin_comment

SLOTS = ("done", "redo")
H = "ab" * 32


def claim(tmp_path, name: str, comment: str, job: str | None = None) -> Claim:
    path = claim_path(str(tmp_path), name)
    if job is not None:
        with open(path, "w") as fd:
            fd.write(job + "\n")
    return Claim(path, comment)


def test_plugin_comment_joins_rule_and_wildcards_like_the_slurm_plugin():
    assert plugin_comment("train", H, "L-2-0123abcd", "done") == f"rule_train_wildcards_{H}_L-2-0123abcd_done"
    assert plugin_comment("sweep_report") == "rule_sweep_report"


def test_a_running_claiming_job_is_in_flight_with_the_slot_it_writes(tmp_path):
    c = claim(tmp_path, "L-2-0123abcd", plugin_comment("train", H, "L-2-0123abcd"), job="41")
    live = {"41": plugin_comment("train", H, "L-2-0123abcd", "redo")}
    assert in_flight({"g": c}, SLOTS, live=live) == {"g": InFlight("41", "redo")}


def test_a_queued_job_without_a_claim_is_found_by_its_comment(tmp_path):
    c = claim(tmp_path, "spliced", plugin_comment("spliced_eval", H))
    live = {"7": "rule_other", "8": plugin_comment("spliced_eval", H)}
    assert in_flight({"s": c}, SLOTS, live=live) == {"s": InFlight("8", "")}


def test_a_stale_claim_naming_an_unrelated_live_job_is_no_claim(tmp_path):
    """The claimed id now belongs to another job (an interactive session, another rule or range):
    never awaited; nothing of this rule is in flight."""
    c = claim(tmp_path, "000000-000001", plugin_comment("dump", H, "000000-000001"), job="41")
    live = {
        "41": "",
        "42": plugin_comment("dump", H, "000001-000002", "done"),
        "43": plugin_comment("train", H, "x", "done"),
    }
    assert in_flight({"r": c}, SLOTS, live=live) == {}


def test_a_claim_of_a_finished_job_is_no_claim(tmp_path):
    c = claim(tmp_path, "L-2-0123abcd", plugin_comment("train", H, "L-2-0123abcd"), job="41")
    assert in_flight({"g": c}, SLOTS, live={"50": "rule_gather_wildcards_" + H}) == {}


def test_a_comment_that_only_starts_like_the_claims_is_another_job(tmp_path):
    """Report of SAE 0123 must not match a comment of SAE 01234...: comments are compared whole."""
    c = claim(tmp_path, "report-0123", plugin_comment("report", H, "0123"))
    assert in_flight({"p": c}, SLOTS, live={"9": plugin_comment("report", H, "01234")}) == {}


def test_await_of_a_job_no_longer_queued_says_at_once_whether_it_finished(tmp_path, capsys):
    """Job 0 is never queued (with or without Slurm here): no wait; the exit status and the line
    say whether the job left its output."""
    from actcache.slurmjobs import await_job

    out = tmp_path / "L-2-0123abcd.done"
    assert await_job("0", str(out)) == 1
    assert "ended without finishing" in capsys.readouterr().out
    out.touch()
    assert await_job("0", str(out)) == 0
    assert f"Slurm job 0 finished {out}" in capsys.readouterr().out
