import pytest

from kvtier.cli import main


@pytest.mark.smollm2
def test_demo_generates_and_plan_matches_measured_kv(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--prompt", "The KV cache grows because", "--max-new-tokens", "4"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "(exact)" in out and "max concurrency" in out
