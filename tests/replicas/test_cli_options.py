"""`kvgen serve`'s replica options are checked before Ray or a model starts: a bad one is exit 2
naming it, and a replica-only option without --replicas is refused, never ignored."""

from __future__ import annotations

import pytest

from kvgen.cli import main
from kvgen.replicas.options import ReplicaOptions


@pytest.mark.parametrize("argv, message", [
    (["--min-replicas", "2"], "--min-replicas configures replicas: also pass --replicas"),
    (["--router", "pow2"], "--router configures replicas"),
    (["--replicas", "0"], "--replicas must be an integer >= 1"),
    (["--replicas", "2", "--max-replicas", "1"], "autoscaling needs"),
    (["--replicas", "2", "--kv-cache-dir", "/tmp/x"], "--kv-cache-dir is one server's directory"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be positive"),
])  # fmt: skip
def test_bad_replica_options_exit_2_naming_the_option(argv: list[str], message: str, capsys) -> None:
    assert main(["serve", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_autoscaling_options_become_ray_serves() -> None:
    options = ReplicaOptions(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=6, cpus_per_replica=2)
    assert options.deployment_options()["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 6}  # fmt: skip
    fixed = ReplicaOptions(replicas=3).deployment_options()
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 1.0} and "autoscaling_config" not in fixed


def test_kvgen_runs_without_ray_and_says_how_to_get_it() -> None:
    """Ray blocked from importing (as when the extra is not installed): the CLI and the server load,
    and --replicas is exit 2 saying to install kvgen[ray]."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None\n"
            "import kvgen.cli, kvgen.server.app, kvgen.replicas.prompt_key, kvgen.replicas.affinity\n"
            "sys.exit(kvgen.cli.main(['serve', '--no-progress', '--replicas', '2']))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "pip install 'kvgen[ray]'" in result.stderr, result.stderr
