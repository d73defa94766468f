"""`python -m nanwidget bench`: the table's shape and the harness's hook hygiene (not timings)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from nanwidget.cli import benchmark as bench
from nanwidget.cli import main

transformers = pytest.importorskip(
    "transformers", reason="the peers and GPT-2 rows need the bench extra: pip install -e .[bench]")


def test_quick_bench_on_mlp_prints_every_variant_for_both_modes(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--models", "mlp", "--rounds", "2", "--block-ms", "5",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "Environment: torch " + torch.__version__ in text
    header = next(line for line in text.splitlines() if line.startswith("model/mode"))
    for column in ("baseline ms", "nanwidget", "nw backward=True", "sentinel", "isnan hook",
                   "DebugUnderflowOverflow", "detect_anomaly", "nw/DUO overhead",
                   "nanwidget vs target", "sentinel vs 1.03x", "nw µs/call",
                   "sentinel µs/batch"):
        assert column in header
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("mlp/")}
    assert set(rows) == {"mlp/forward", "mlp/train"}
    # backward frames and anomaly mode need a backward pass: no number on the forward row
    # (columns: case, baseline, nanwidget, backward=True, sentinel, isnan, DUO, anomaly, share,
    # nw µs/call, sentinel µs/batch, target, verdict, sentinel verdict)
    assert rows["mlp/forward"][3] == "-" and rows["mlp/forward"][7] == "-"
    assert rows["mlp/train"][3].endswith("x") and rows["mlp/train"][7].endswith("x")
    assert rows["mlp/train"][4].endswith("x")  # sentinel mode, with its gradient check
    for added in rows["mlp/train"][9:11]:  # the added microseconds ("~0": under the noise)
        assert added == "~0" or float(added) > 0
    assert rows["mlp/train"][11] == "<=1.25x"
    assert rows["mlp/train"][12] in ("PASS", "MISS")
    assert rows["mlp/train"][-1] in ("PASS", "(ratio>1.03)")

    data = json.loads(out_json.read_text())
    assert [(r["model"], r["mode"]) for r in data["rows"]] == [("mlp", "forward"), ("mlp", "train")]
    train = data["rows"][1]
    assert set(train["ratios"]) == {"nanwidget", "nanwidget_backward", "sentinel", "isnan_hook",
                                    "debug_underflow", "anomaly"}
    assert train["sentinel_target"] == 1.03 and "replay" not in data  # no gpt2: no replay timing
    assert all(len(times) == 2 for times in train["block_seconds"].values())
    assert data["environment"]["threads"] == torch.get_num_threads()


def test_markdown_table_has_one_line_per_row_plus_header(capsys):
    assert main(["bench", "--quick", "--models", "mlp", "--modes", "train", "--rounds", "1",
                 "--block-ms", "2", "--markdown"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(lines) == 3
    assert lines[0].startswith("| model/mode | baseline ms | nanwidget | nw backward=True | sentinel |")
    assert set(lines[1]) <= set("|-:")
    assert lines[2].startswith("| mlp/train |")


def test_debug_underflow_hooks_are_taken_off_after_its_block():
    case = bench.build_case("mlp", "forward")
    with bench.ALL_VARIANTS["debug_underflow"].attach(case):
        # one hook per module, as transformers registers them, and they do fire
        assert bench.hook_count(case.model) == len(list(case.model.modules()))
        case.step()
    assert bench.hook_count(case.model) == 0
    assert nn.Module.register_forward_hook.__name__ == "register_forward_hook"


def test_a_variant_that_leaks_hooks_stops_the_benchmark():
    case = bench.build_case("mlp", "train")

    @contextlib.contextmanager
    def leaky(case):
        case.model[0].register_forward_hook(lambda *args: None)
        yield

    with pytest.raises(bench.HookLeak, match="left 1 hook"):
        bench._measure(case, bench.Variant("leaky", leaky), steps=1, warmup=0, seed=0,
                       device="cpu")


def test_every_variant_leaves_the_model_and_anomaly_mode_as_it_found_them():
    case = bench.build_case("mlp", "train")
    for name in bench.available_variants(floors=True):
        bench._measure(case, bench.ALL_VARIANTS[name], steps=1, warmup=1, seed=0, device="cpu")
        assert bench.hook_count(case.model) == 0, name
        assert not torch.is_anomaly_enabled(), name


def test_unknown_model_is_one_clear_error():
    with pytest.raises(SystemExit, match="unknown model resnet"):
        main(["bench", "--models", "resnet"])


@pytest.mark.parametrize("flag,value", [("--models", "mlp,,gpt2"), ("--models", "mlp,"),
                                        ("--models", "mlp,mlp"), ("--modes", "forward,,train")])
def test_an_empty_or_repeated_part_in_a_list_is_one_clear_error(flag, value):
    with pytest.raises(SystemExit, match="empty or repeated part"):
        main(["bench", flag, value])


def test_overhead_share_and_verdict_follow_the_issue_targets():
    row = bench.BenchRow("mlp", "train", "", 1, 1, 1.0,
                         {"nanwidget": 1.2, "debug_underflow": 3.0})
    assert row.overhead_share == pytest.approx(0.1)
    assert row.verdict() == "PASS"
    row.ratios["nanwidget"] = 1.3
    assert row.verdict() == "MISS (ratio>1.25, share>0.10)"
    forward = bench.BenchRow("gpt2", "forward", "", 1, 1, 1.0, {"nanwidget": 1.29})
    assert forward.overhead_share is None and forward.verdict() == "PASS"


def test_compiled_rows_time_only_the_sentinel_against_the_compiled_model():
    variants = [n for n in bench.available_variants()
                if bench.ALL_VARIANTS[n].runs_on("gpt2-compiled", "train")]
    assert variants == ["baseline", "sentinel"]
    row = bench.BenchRow("gpt2-compiled", "forward", "", 1, 1, 1.0, {"sentinel": 1.02})
    assert row.target is None and row.verdict() == "-" and row.sentinel_verdict() == "PASS"
    row.ratios["sentinel"] = 1.05
    assert row.sentinel_verdict() == "MISS (ratio>1.03)"


def test_rows_give_the_added_microseconds_per_batch_and_per_module_call():
    case = bench.build_case("mlp", "forward")
    calls = []
    handles = [m.register_forward_pre_hook(lambda m, a: calls.append(m)) for m in case.model.modules()]
    case.step()
    for handle in handles:
        handle.remove()
    assert case.module_calls == len(calls) > 1
    row = bench.BenchRow("mlp", "forward", "", 1, 1, 0.5, {"nanwidget": 1.2, "sentinel": 1.01},
                         module_calls=10)
    assert row.overhead_us("sentinel") == pytest.approx(5.0)
    assert row.us_per_module_call() == pytest.approx(10.0)
    assert row.overhead_us("isnan_hook") is None
    result = bench.BenchResult([row], {}, ["baseline", "nanwidget", "sentinel"])
    header, cells = result.columns(), result.table_cells()[0]
    assert cells[header.index("nw µs/call")] == "10.00"
    assert cells[header.index("sentinel µs/batch")] == "5.0"
    # A row whose rounds ran faster watched than bare: the noise, not a negative cost.
    noisy = bench.BenchRow("gpt2", "train", "", 1, 1, 300.0, {"nanwidget": 0.98, "sentinel": 0.99},
                           module_calls=100)
    cells = bench.BenchResult([noisy], {}, ["baseline", "nanwidget", "sentinel"]).table_cells()[0]
    assert cells[header.index("nw µs/call")] == cells[header.index("sentinel µs/batch")] == "~0"


def _old_revision(tmp_path):
    """A git repository whose nanwidget is an old tree: absolute imports of its own package,
    a watch without the ``mode`` and ``backward`` options."""
    package = tmp_path / "nanwidget"
    package.mkdir()
    (package / "__init__.py").write_text("import nanwidget.old_watch as _w\nwatch = _w.watch\n")
    (package / "old_watch.py").write_text(
        "import contextlib\n"
        "MARK = __import__('nanwidget.marker', fromlist=['X']).X\n"
        "@contextlib.contextmanager\n"
        "def watch(model, on_nan='raise'):\n"
        "    yield model\n")
    (package / "marker.py").write_text("X = 'old tree'\n")
    for command in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "old"]):
        subprocess.run(["git", "-C", str(tmp_path), *command], check=True)
    return tmp_path


def test_compare_with_an_old_tree_skips_what_it_cannot_build_with_one_line(tmp_path):
    repo = _old_revision(tmp_path)
    revision, commit = bench.load_revision("HEAD", repo)
    # its absolute imports reach its own modules, never this tree's
    assert revision.old_watch.MARK == "old tree" and revision.__name__.startswith("nanwidget_rev_")
    lines = []
    result = bench.run_benchmark(["mlp"], ["forward", "train"], rounds=1, block_seconds=0.002,
                                 warmup=0, variants=list(bench.WATCH_VARIANTS), compare="HEAD",
                                 compare_repo=repo, progress=lines.append)
    skipped = [line for line in lines if "skipping" in line]
    # nanwidget runs there; backward and sentinel need options it lacks: one line each
    assert len(skipped) == 2 and result.skipped == skipped
    assert any("skipping sentinel" in line and "mode" in line for line in skipped)
    assert any("skipping nanwidget_backward" in line for line in skipped)
    assert all(set(row.versus) == {"nanwidget"} for row in result.rows)


def test_compare_removes_its_copy_of_the_old_tree_at_exit(tmp_path):
    repo = _old_revision(tmp_path)
    script = ("import sys; from nanwidget.cli import benchmark as bench\n"
              f"revision, _ = bench.load_revision('HEAD', {str(repo)!r})\n"
              "print(revision.__file__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    copied = pathlib.Path(done.stdout.strip())
    assert copied.name == "__init__.py" and "nanwidget-compare-" in str(copied)
    assert not copied.parent.parent.exists()


def test_cpu_clock_times_this_process_only_and_refuses_a_gpu(capsys):
    assert main(["bench", "--quick", "--models", "mlp", "--modes", "forward", "--rounds", "1",
                 "--block-ms", "2", "--clock", "cpu", "--no-replay"]) == 0
    assert "timed by CPU time" in capsys.readouterr().out
    with pytest.raises(ValueError, match="CPU work only"):
        bench.run_benchmark(["mlp"], ["forward"], rounds=1, device="cuda", clock="cpu")
    with pytest.raises(ValueError, match="clock must be one of"):
        bench.run_benchmark(["mlp"], ["forward"], rounds=1, clock="sundial")


def test_floors_time_the_lean_stand_ins_and_give_their_columns(capsys):
    from nanwidget.core import native
    if not native.available():
        pytest.skip(f"the floors need the native kernel: {native.status()}")
    assert main(["bench", "--quick", "--models", "mlp", "--rounds", "1", "--block-ms", "2",
                 "--clock", "cpu", "--no-replay", "--floors"]) == 0
    out = capsys.readouterr().out
    for column in ("full floor", "sentinel floor", "floor/DUO overhead", "sentinel floor µs/batch"):
        assert column in out
    result = bench.run_benchmark(["mlp"], ["train"], rounds=1, block_seconds=0.002, floors=True,
                                 variants=["baseline", "debug_underflow", *bench.FLOOR_VARIANTS])
    row = result.rows[0]
    assert set(row.ratios) == {"debug_underflow", *bench.FLOOR_VARIANTS}
    # One round of 2 ms blocks is too short to trust DebugUnderflowOverflow's ratio (the CPU
    # clock may read a tick or nothing), so the share's arithmetic is checked on set ratios.
    assert row.to_dict()["floor_share"] == row.floor_share
    known = bench.BenchRow("mlp", "train", "", 1, 1, 1.0, {"nanwidget": 1.4, "floor_full": 1.1,
                                                          "debug_underflow": 5.0})
    assert known.floor_share == pytest.approx(0.1 / 4.0)
    assert known.overhead_share == pytest.approx(0.4 / 4.0)
    assert known.to_dict()["floor_share"] == pytest.approx(0.025)
    known.ratios["debug_underflow"] = 0.98  # DebugUnderflowOverflow no slower: no share
    assert known.floor_share is None and known.overhead_share is None
    with pytest.raises(ValueError, match="CPU stand-ins"):
        bench.run_benchmark(["mlp"], ["forward"], rounds=1, device="cuda", floors=True)


@pytest.fixture
def floor_reads(monkeypatch) -> list[tuple]:
    """The shapes of the tensors the floors read with the C reader, in order (skips where the
    native kernel is not in use: the floors are built on it, and the bench skips them too)."""
    from nanwidget.core import native
    if not native.available():
        pytest.skip(f"the floors need the native kernel: {native.status()}")
    read = native.contiguous_reader()
    shapes: list[tuple] = []

    def counting_reader() -> object:
        def reader(tensor, result):
            shapes.append(tuple(tensor.shape))
            return read(tensor, result)
        return reader

    monkeypatch.setattr(native, "contiguous_reader", counting_reader)
    return shapes


@pytest.mark.parametrize("name", ["floor_full", "floor_sentinel"])
def test_a_floor_stand_in_reads_what_its_watch_reads_and_changes_nothing(name, floor_reads):
    shapes = floor_reads
    torch.manual_seed(0)
    model, inputs, loss_fn, _ = bench._BUILDERS["mlp"]()
    case = bench.Case("mlp", "train", model, lambda: None, {}, "")
    expected = model(*inputs)
    with bench.ALL_VARIANTS[name].attach(case):
        output = model(*inputs)
        loss_fn(output).backward()
    assert torch.equal(output, expected) and "forward" not in vars(model)
    assert bench.hook_count(case.model) == 0
    parameters = {tuple(p.shape) for p in case.model.parameters()}
    if name == "floor_full":  # every weight, every module's input and output
        assert parameters <= set(shapes) and (64, 64) in shapes and (64, 256) in shapes
    else:  # the root's output, then every parameter's gradient
        assert shapes[0] == (64, 10) and set(shapes[1:]) == parameters


def test_the_sentinel_floor_reads_every_output_tensor_the_sentinel_checks(floor_reads):
    # A transformers model's output holds a key/value cache object: the sentinel checks its
    # tensors, so a floor that read only the logits measured less work than the check needs.
    from nanwidget.core.sentinel.check import float_leaves
    pytest.importorskip("transformers")  # the GPT-2 rows are built with it, as in the bench
    shapes = floor_reads
    torch.manual_seed(0)
    model, inputs, _, _ = bench._BUILDERS["gpt2-small"]()
    model.eval()
    with torch.no_grad():
        checked = sorted(tuple(values.shape) for _, _, values in float_leaves(model(*inputs)))
    case = bench.Case("gpt2-small", "forward", model, lambda: None, {}, "")
    with bench.ALL_VARIANTS["floor_sentinel"].attach(case), torch.no_grad():
        model(*inputs)
    assert len(checked) == 1 + 2 * model.config.n_layer  # the logits, each layer's keys, values
    assert sorted(shapes) == checked


def test_the_floors_read_a_tensor_above_the_c_readers_size_as_the_watches_do():
    # The logits of a 50257-token vocabulary (12.8M floats) pass the C reader's 4M: the watches
    # read them through ctypes, and a floor that skipped them measured a cost it never paid.
    from nanwidget.core import native
    if not native.available():
        pytest.skip(f"the floors need the native kernel: {native.status()}")
    torch.manual_seed(0)
    logits = torch.randn(5_000_000)
    assert native.contiguous_reader()(logits, native.result_buffer()) is None
    low, high = bench._floor_reader()(logits)
    assert (low, high) == (logits.abs().min().item(), logits.abs().max().item())


@pytest.mark.parametrize("model_name", ["mlp", "transformer", "gpt2-small"])
def test_a_train_step_runs_on_the_device_it_is_built_for(model_name):
    # `bench --device cuda` built the train rows' loss targets on the CPU: every train row
    # raised "Expected all tensors to be on the same device" on a GPU. The meta device stands in
    # for one here: a tensor left on the CPU fails the same way.
    case = bench.build_case(model_name, "train", device="meta")
    case.step()
    assert all(p.device.type == "meta" for p in case.model.parameters())
