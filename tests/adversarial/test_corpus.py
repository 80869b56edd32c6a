"""Every attack of the corpus ends as it must (FAIL with its reason, killed, or blocked), and the
honest submissions PASS: no false alarms. Each test is a real child process evaluating the
attack, as the service would; on CPU here, on the GPU under the `gpu` marker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.corpus import ATTACKS, Attack, run_attack
from tests.adversarial.submissions import writes_outside

CPU_ATTACKS = [a for a in ATTACKS if "cpu" in a.devices]
GPU_ATTACKS = [a for a in ATTACKS if "cuda" in a.devices]


@pytest.fixture(autouse=True)
def remove_what_was_planted() -> Iterator[None]:
    """Where the child could write outside its folder (an OS without namespaces), the harness
    tree must not keep what writes_outside left there."""
    yield
    for path in writes_outside.targets():
        if path.name.endswith(writes_outside.PLANTED) and "harness" in path.parts:
            path.unlink(missing_ok=True)


def _assert_caught(attack: Attack, device: str, workdir: Path) -> None:
    got = run_attack(attack, device, workdir)
    assert got.caught(attack), (
        f"{attack.name} on {device}: expected {attack.expected} with one of {attack.reasons}, "
        f"got {got.outcome}: {got.reasons[:6]} observed={got.observed}"
    )


@pytest.mark.parametrize("attack", CPU_ATTACKS, ids=lambda a: a.name)
def test_attack_on_cpu(attack: Attack, tmp_path: Path) -> None:
    _assert_caught(attack, "cpu", tmp_path / "work")


@pytest.mark.gpu
@pytest.mark.parametrize("attack", GPU_ATTACKS, ids=lambda a: a.name)
def test_attack_on_gpu(attack: Attack, tmp_path: Path) -> None:
    _assert_caught(attack, "cuda", tmp_path / "work")


def test_the_pre_screen_names_what_the_snooping_attacks_do(tmp_path: Path) -> None:
    """Blocked is not silent: the reviewer sees what the submission tried."""
    by_name = {a.name: a for a in ATTACKS}
    secrets = run_attack(by_name["reads_secrets"], "cpu", tmp_path / "secrets")
    network = run_attack(by_name["opens_network"], "cpu", tmp_path / "network")
    assert any("opens a network connection" in w for w in network.warnings), network.warnings
    assert any(("reads" in w and "environ" in w) or "os.environ" in w for w in secrets.warnings), (
        secrets.warnings
    )


def test_the_honest_submission_has_no_warnings(tmp_path: Path) -> None:
    honest = next(a for a in ATTACKS if a.name == "honest")
    got = run_attack(honest, "cpu", tmp_path / "work")
    assert got.outcome == "PASS" and got.warnings == [], got
