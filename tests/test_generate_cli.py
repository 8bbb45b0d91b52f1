"""`kvtier generate`: the options it shares with `kvtier serve` come from the same fields and are checked the same way."""

import pytest

from kvtier.cli import _register_all, app, main


def test_shared_options_have_the_serve_defaults_and_help():
    import typer.main

    from kvtier.config import EngineConfig

    _register_all()
    generate = {p.name: p for p in typer.main.get_command(app).commands["generate"].params}
    serve = {p.name: p for p in typer.main.get_command(app).commands["serve"].params}
    for name in ("model", "codec", "kv_codec", "block_tokens"):
        assert generate[name].opts == serve[name].opts and serve[name].help.startswith(generate[name].help)
    assert (generate["model"].default, generate["block_tokens"].default) == ("smollm2", EngineConfig().block_tokens)


@pytest.mark.parametrize("argv, message", [
    (["--kv-codec", "int3"], "kvtier: error: kv_codec must be one of raw, fp8, int8, int4, int2, got 'int3'\n"),
    (["--block-tokens", "0"], "kvtier: error: EngineConfig.block_tokens must be positive, got 0\n"),
    (["--codec", "zip"], "kvtier: error: unknown codec 'zip': use one of raw, fp8, int8, int4, int2, optionally "
                         "with '+zstd'\n"),
    (["--kv-codec", "int4", "--device-kv-budget", "1MiB"],
     "kvtier: error: --kv-codec (quantized resident KV) and --device-kv-budget (layer offload) do not combine\n"),
])
def test_bad_shared_options_exit_2_before_loading_a_model(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "hello", *argv])
    assert info.value.code == 2 and capsys.readouterr().err == message
