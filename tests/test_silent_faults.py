"""The fine-tuner's path takes nothing silently (issue 45): the keys given beside
``model.init_from`` are used or refused, the base directory is stored absolute, Adam's
betas are checked as float32 holds them, an empty ``--workdir`` and a ``bpe:VOCAB`` too
small to exist are refused before any work, the processes of a run compare their
workdirs, and a run's tokenizer is written atomically and checked against the digest its
checkpoints recorded.

No train step is compiled here: each test is a config, a file or a pipeline state.
"""
import json
import os
import threading

import numpy as np
import pytest

from jaxmp.train import tokenizer as tokenizer_module
from jaxmp.train.config import load_config, validate_config

XDIST_PER_TEST = True


def _char_tokenizer(path):
    """A character-level tokenizer.json (printable ASCII, <unk>, </s>) with a
    tokenizer_config.json naming </s>; returns the id of </s>."""
    from tokenizers import Tokenizer, models

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<unk>": len(vocab), "</s>": len(vocab) + 1})
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(
        str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return vocab["</s>"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-layer Qwen3 config.json and a character tokenizer: what load_config reads of a
    ``model.init_from`` directory (no weights are loaded by these tests)."""
    path = tmp_path_factory.mktemp("base")
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False}))
    eos = _char_tokenizer(path)
    return path, eos


@pytest.mark.parametrize("prefix", ["--config.", ""])
def test_a_model_key_beside_init_from_that_contradicts_it_is_refused(base, prefix):
    """train.py hands load_config its items with the --config. prefix on: the key given is
    compared with DIR's config.json all the same (before, a prefixed key was not counted
    as given and DIR's value silently replaced it: 2 layers trained, exit 0)."""
    path, _ = base
    with pytest.raises(ValueError, match=r"^model.num_layers=4 contradicts .*config.json \(2\)"):
        load_config("configs/finetune.py", [f"{prefix}model.init_from={path}",
                                            f"{prefix}model.num_layers=4"])


def test_a_runtime_key_given_beside_init_from_is_the_users(base):
    """model.max_len given is used, not replaced by DIR's 64: with data.seq_len above it
    the run is refused."""
    path, _ = base
    cfg = load_config("configs/finetune.py", [f"--config.model.init_from={path}",
                                              "--config.model.max_len=16",
                                              "--config.data.seq_len=32"])
    assert cfg.model.max_len == 16
    with pytest.raises(ValueError, match=r"data.seq_len=32 exceeds model.max_len=16"):
        validate_config(cfg, 1)


@pytest.mark.parametrize("prefix", ["--config.", ""])
def test_data_tokenizer_bytes_given_beside_init_from_stays_bytes(base, prefix):
    """data.tokenizer=bytes equals the default, yet given it is the user's: load_config and
    validate_config keep it (before, DIR's tokenizer.json replaced it)."""
    path, _ = base
    overrides = [f"{prefix}model.init_from={path}", f"{prefix}data.tokenizer=bytes",
                 f"{prefix}data.seq_len=32"]
    cfg = load_config("configs/finetune.py", overrides)
    assert cfg.data.tokenizer == "bytes" and cfg.data.eod_id == -1
    assert validate_config(cfg, 1).config.data.tokenizer == "bytes"
    # not given: DIR's tokenizer and its eos token, by absolute path
    cfg = load_config("configs/finetune.py", [overrides[0], overrides[2]])
    assert cfg.data.tokenizer == os.path.join(str(path), "tokenizer.json")
    assert validate_config(cfg, 1).config.data.eod_id == base[1]


def test_a_relative_init_from_is_stored_absolute(base, monkeypatch):
    """The run's config names its base by absolute path, whatever directory it ran from."""
    path, _ = base
    monkeypatch.chdir(path.parent)
    cfg = load_config("configs/finetune.py", [f"--config.model.init_from={path.name}",
                                              "--config.data.seq_len=32"])
    assert cfg.model.init_from == str(path) and os.path.isabs(cfg.data.tokenizer)
    assert validate_config(cfg, 1).config.model.init_from == str(path)


@pytest.mark.parametrize("key,value,ok", [
    ("optim.b1", 0.999999999, False),  # float32(0.999999999) == 1.0
    ("optim.b2", 0.99999999, False),
    ("optim.b2", 1 - 2.0 ** -25, False),  # the tie rounds to even: 1.0
    ("optim.b2", 1 - 2.0 ** -24, True),  # float32's largest value below 1
    ("optim.b1", 0.0, True),
])
def test_adam_betas_are_checked_as_float32_holds_them(key, value, ok):
    assert (float(np.float32(value)) < 1.0) == ok  # the reference: NumPy's float32 rounding
    cfg = load_config("configs/tiny_moe.py", [f"{key}={value!r}"])
    if ok:
        validate_config(cfg, 1)
        return
    with pytest.raises(ValueError, match=rf"^{key}={value!r} is not allowed; .*float32"):
        validate_config(cfg, 1)


@pytest.mark.parametrize("spec", ["bpe:0", "bpe:10", "bpe:-5", "bpe:256", "bpe:x"])
def test_a_bpe_vocabulary_that_cannot_exist_is_refused_by_the_config_check(spec):
    """Refused by validate_config, before any document is read (before: an empty message
    after the corpus was read, 7-9 s in)."""
    cfg = load_config("configs/tiny_moe.py", [f"data.tokenizer={spec}"])
    with pytest.raises(ValueError, match=r"data.tokenizer=.* VOCAB an integer >= 257"):
        validate_config(cfg, 1)
    validate_config(load_config("configs/tiny_moe.py", ["data.tokenizer=bpe:257"]), 1)


@pytest.mark.parametrize("workdir", ["", " "])
def test_an_empty_workdir_is_refused(workdir, tmp_path, monkeypatch):
    """``--workdir=`` is not the current directory: refused, nothing written there."""
    from jaxmp.train.workdir import prepare_workdir

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--workdir is empty"):
        prepare_workdir(workdir)
    assert os.listdir(tmp_path) == []


class _KeyValueStore:
    """The part of JAX's distributed client that check_same_config uses: what another
    process published is in ``theirs``."""

    def __init__(self, theirs):
        self.values = {"jaxmp/config/1": theirs}

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.values[key]


@pytest.mark.parametrize("same", [True, False])
def test_processes_given_different_workdirs_are_refused_before_training(tmp_path, monkeypatch,
                                                                        same):
    """Two processes with one config but different --workdir trained to their first save
    and then both waited for ever: the workdir is compared with the config."""
    from jax._src import distributed as jax_distributed

    from jaxmp.train import distributed

    config = {"train": {"steps": 4}}
    theirs = dict(config, **{"--workdir": str(tmp_path / ("a" if same else "b"))})

    class State:
        client = _KeyValueStore(json.dumps(theirs, sort_keys=True))
        num_processes, process_id = 2, 0

    monkeypatch.setattr(jax_distributed, "global_state", State())
    monkeypatch.chdir(tmp_path)
    if same:  # a relative path is compared as the absolute path it names
        distributed.check_same_config(config, 1, workdir="a")
        return
    with pytest.raises(ValueError, match=r"different configs \(--workdir: .*a' here, .*b' "
                                         r"there\); give every process the same --workdir"):
        distributed.check_same_config(config, 1, workdir="a")


def test_a_tokenizer_is_written_atomically(tmp_path, monkeypatch):
    """A write that dies before its rename leaves the old tokenizer.json whole (before, a
    kill while a trained BPE was written left it cut short, and every rerun failed)."""
    from tokenizers import Tokenizer

    tok = tokenizer_module.HFTokenizer(tokenizer_module.ByteTokenizer().to_hf(), "t", 256)
    path = tok.save(tmp_path)
    before = path.read_bytes()
    assert Tokenizer.from_file(str(path)).get_vocab_size() == tok.vocab_size

    def killed(src, dst):
        raise KeyboardInterrupt  # as a signal between the write and the rename

    monkeypatch.setattr(tokenizer_module.os, "replace", killed)
    other = tokenizer_module.HFTokenizer(tokenizer_module.ByteTokenizer().to_hf(), "t", 10)
    with pytest.raises(KeyboardInterrupt):
        other.save(tmp_path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["tokenizer.json"]


class _Iterator:
    def get_state(self):
        return {"next_index": 3}


def _pipeline(tokenizer):
    from jaxmp.train.data import _STATE_VERSION, DataPipeline

    fingerprint = {"train_windows": 10, "seq_len": 8, "global_batch_size": 2, "seed": 0,
                   "tokenizer": tokenizer.digest()}
    return DataPipeline(train_iter=_Iterator(), eval_batches=(), tokenizer=tokenizer, train_tokens=0,
                        eval_tokens=0, num_documents=1, _fingerprint=fingerprint), _STATE_VERSION


def test_a_tokenizer_replaced_by_another_of_the_same_size_is_refused_on_resume(tmp_path):
    """Two tokenizers of 257 ids that map one byte differently: the checkpoint's data state
    recorded the first one's SHA-256, and a pipeline with the second refuses it; a state
    saved before the digest was recorded is still taken."""
    from tokenizers import Tokenizer

    first = tokenizer_module.HFTokenizer(tokenizer_module.ByteTokenizer().to_hf(), "a", 256)
    data = json.loads(first.tokenizer.to_str())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, another mapping
    second = tokenizer_module.HFTokenizer(Tokenizer.from_str(json.dumps(data)), "b", 256)
    assert second.vocab_size == first.vocab_size and second.digest() != first.digest()
    saved, version = _pipeline(first)
    state = saved.get_state()
    pipe, _ = _pipeline(second)
    with pytest.raises(ValueError, match=r"tokenizer \(b\) is not the one the checkpoint was "
                                         r"trained with"):
        pipe.check_state(state)
    saved.check_state(state)  # the same tokenizer: taken
    old = dict(state, fingerprint={k: v for k, v in state["fingerprint"].items()
                                   if k != "tokenizer"})
    pipe.check_state(old)  # written before runs recorded the digest


def test_a_tokenizer_given_by_path_is_kept_in_the_run(tmp_path):
    """keep_tokenizer copies a tokenizer file into the workdir (the run's readers need
    nothing outside it), leaves an identical copy alone and replaces a torn one."""
    src = tmp_path / "src"
    src.mkdir()
    eos = _char_tokenizer(src)
    spec = str(src / "tokenizer.json")
    tok = tokenizer_module.load_tokenizer(spec, eod_id=eos)
    run = tmp_path / "run"
    run.mkdir()
    assert tokenizer_module.kept_tokenizer(run, spec) is None
    kept = tokenizer_module.keep_tokenizer(tok, spec, run)
    assert kept == run / "tokenizer.json" == tokenizer_module.kept_tokenizer(run, spec)
    again = tokenizer_module.load_tokenizer(str(kept), eod_id=eos)
    assert again.digest() == tok.digest()
    assert list(again.encode("ab", add_eos=True)) == [ord("a") - 32, ord("b") - 32, eos]
    mtime = kept.stat().st_mtime_ns
    tokenizer_module.keep_tokenizer(tok, spec, run)
    assert kept.stat().st_mtime_ns == mtime
    kept.write_bytes(kept.read_bytes()[:100])  # torn
    tokenizer_module.keep_tokenizer(tok, spec, run)
    assert tokenizer_module.load_tokenizer(str(kept), eod_id=eos).digest() == tok.digest()
    for spec_ in ("bytes", "bpe:300"):
        assert tokenizer_module.keep_tokenizer(tok, spec_, run) is None


_SIGINT_DURING_IMPORTS = r"""
import importlib.abc, os, runpy, signal, sys

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell script's background job inherits


class SigintOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "jaxmp.train":  # while train.py imports the trainer
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, SigintOnImport())
sys.argv = ["train.py", "--workdir", sys.argv[1], "--config.train.steps=2"]
runpy.run_path("train.py", run_name="__main__")
"""


def test_sigint_during_the_imports_of_a_job_started_with_sigint_ignored_exits_130(tmp_path):
    """A job started in the background by a shell script inherits SIGINT ignored; train.py
    honours SIGINT while it trains, and now before (the imports) and after (the closing
    sample) too: before, such a SIGINT did nothing and the run trained on to exit 0. The
    signal is sent by the process itself as it imports jaxmp.train, so the moment is
    certain."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SIGINT_DURING_IMPORTS, str(tmp_path / "w")],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: SIGINT outside training")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("extra", [[], ["--target", "H200"]])
def test_the_report_refuses_more_devices_than_it_can_simulate(extra, capsys, monkeypatch):
    """--devices 100000 aborted the process at 19 GB of host memory (exit 134): refused
    in one line, before XLA_FLAGS is touched or JAX starts."""
    from jaxmp.analysis import report

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    before = os.environ["XLA_FLAGS"]
    with pytest.raises(SystemExit) as info:
        report.main(["--config", "configs/tiny_moe.py", "--devices", "100000", *extra])
    assert info.value.code == 2 and os.environ["XLA_FLAGS"] == before
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--devices must be in [1, {report.MAX_DEVICES}], got 100000 (each "
                        f"device is simulated on this machine)")


def test_a_reader_opens_the_checkpoints_without_an_absl_warning(tmp_path, caplog):
    """Every sample and export printed orbax's 'CheckpointManagerOptions.read_only=True,
    setting save_interval_steps=0' through absl: a warning about nothing the user did."""
    import logging

    from jaxmp.train.checkpoint import Checkpointer

    (tmp_path / "checkpoints").mkdir()
    absl_filters = list(logging.getLogger("absl").filters)
    with caplog.at_level(logging.WARNING):
        with Checkpointer(tmp_path, read_only=True) as ckpt:
            assert ckpt.all_steps() == []
    assert not [r for r in caplog.records if "save_interval_steps" in r.getMessage()]
    # nor orbax's 'Given directory is read only' (jaxmp.train.load printed it), and the
    # logger is left as it was
    assert not [r for r in caplog.records if "read only" in r.getMessage()]
    assert logging.getLogger("absl").filters == absl_filters


@pytest.mark.parametrize("body,what", [
    ("def get_config():\n    raise KeyboardInterrupt\n", r"get_config\(\) raised KeyboardInterrupt"),
    ("raise KeyboardInterrupt\n", r"fails to run: KeyboardInterrupt"),
])
def test_a_config_file_that_raises_keyboardinterrupt_is_one_line(tmp_path, body, what):
    """Its own code raising KeyboardInterrupt was a traceback (it is no Exception)."""
    path = tmp_path / "cfg.py"
    path.write_text(body)
    with pytest.raises(ValueError, match=rf"^config file .*cfg.py.*{what}"):
        load_config(str(path))


def test_a_jsonl_record_nested_thousands_deep_is_one_line(tmp_path):
    """json.loads raised RecursionError (a traceback) on a record nested 100,000 deep."""
    from jaxmp.train.corpus import load_documents

    good = json.dumps({"text": "def f(): pass"})
    (tmp_path / "a.jsonl").write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"a.jsonl, line 2: JSON nested too deeply to read"):
        load_documents(str(tmp_path / "a.jsonl"), "text", [])


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_a_named_pipe_as_a_tokenizer_is_refused_unopened(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"is not a regular file"):
        tokenizer_module.load_tokenizer(str(path))


def test_the_report_entry_point_hides_xlas_cpp_log_lines_unless_asked(monkeypatch):
    """python -m jaxmp.report --target printed XLA's own W1204/E1204 lines (remat,
    gpu_hlo_schedule) beside its verdict; the entry point sets TF_CPP_MIN_LOG_LEVEL=3
    unless the user set it."""
    from jaxmp._entry import quiet_xla_logs

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    quiet_xla_logs()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    quiet_xla_logs()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


@pytest.mark.parametrize("overrides", [
    [], ["model.num_layers=5", "model.mlp_only_layers=(3,)"],
    ["model.num_experts=0", "model.num_shared_experts=0"], ["precision.policy=pure_bf16"],
    ["model.num_layers=3", "model.scan_layers=True"],
])
def test_parameter_bytes_equal_the_built_models(overrides):
    """parameter_bytes (two one-layer models) against the whole model built abstractly."""
    import jax
    from flax import nnx

    from jaxmp.models import MoETransformer
    from jaxmp.train.experiment import parameter_bytes

    s = validate_config(load_config("configs/tiny_moe.py", overrides), 1)
    model = nnx.eval_shape(lambda: MoETransformer(s.model, s.rules, rngs=nnx.Rngs(0)))
    built = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert parameter_bytes(s.model, s.rules) == built


def test_a_model_whose_parameters_cannot_fit_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """model.num_layers=100000 gave no answer in 10 minutes: refused in a second, naming
    the size, and nothing is built or written."""
    from jaxmp.train import loop
    from jaxmp.train import preflight

    monkeypatch.setattr(preflight, "device_memory", lambda device: (20 * 2**30, "a 20 GiB device"))
    config = load_config("configs/tiny_moe.py", ["model.num_layers=100000"])
    with pytest.raises(ValueError, match=r"^the model \(model.num_layers=100000.*has 29.1 GiB of "
                                         r"parameters.*a device has 20.00 GiB \(a 20 GiB device\)"):
        loop.train_and_evaluate(config, str(tmp_path / "w"), num_devices=1)
    assert not (tmp_path / "w").exists()


def test_param_keys_draw_nnxs_own_keys_and_leave_the_stream_where_nnx_would():
    """ParamKeys (the model's key source: one count update instead of one per parameter,
    which made building n layers take time ~n**2) draws rngs.params()'s keys exactly."""
    import jax
    from flax import nnx

    from jaxmp.models.layers import ParamKeys

    mine, theirs = nnx.Rngs(3), nnx.Rngs(3)
    keys = ParamKeys(mine)
    drawn = [keys.params() for _ in range(5)]
    want = [theirs.params() for _ in range(5)]
    assert all(np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
               for a, b in zip(drawn, want))
    keys.commit()
    assert np.array_equal(jax.random.key_data(mine.params()),
                          jax.random.key_data(theirs.params()))


@pytest.mark.parametrize("config,given,want", [
    ("configs/finetune.py", None, "runs/finetune"),
    ("configs/tiny_moe.py", None, "runs/tiny_moe"),
    ("configs/finetune.py", "elsewhere", "elsewhere"),
])
def test_train_py_defaults_the_workdir_to_the_configs_name(config, given, want, base, tmp_path,
                                                           monkeypatch):
    """Without --workdir a run of configs/NAME.py goes to runs/NAME: before, every config
    defaulted to runs/tiny, so a fine-tune without --workdir tried to resume the tiny_moe
    run and was refused with a list of differing settings."""
    from _configs import ROOT
    from absl import flags

    import train

    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(train, "train_and_evaluate",
                        lambda config, workdir, **kw: ran.append(workdir))
    flags.FLAGS["workdir"].unparse()  # a fresh process's flag: not given
    argv = ["train.py", "--config", str(ROOT / config), "--config.data.seq_len=32"]
    if config.endswith("finetune.py"):
        argv.append(f"--config.model.init_from={base[0]}")
    if given is not None:
        argv.append(f"--workdir={given}")
    with pytest.raises(SystemExit) as e:
        train.main(train._parse_flags(argv))
    assert e.value.code in (0, None) and ran == [want]
    flags.FLAGS["workdir"].unparse()


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_init_from_beside_finetune_py_is_refused(value):
    """``--config.model.init_from=$BASE`` with BASE unset trained jaxmp's default model from
    random weights, exit 0."""
    with pytest.raises(ValueError, match=r"^model\.init_from='\s*' is empty, and config file "
                                         r"'configs/finetune\.py' takes its model from it"):
        load_config("configs/finetune.py", [f"--config.model.init_from={value}"])
    # a config with a model of its own: '' is its documented random initialisation
    assert load_config("configs/tiny_moe.py", ["model.init_from="]).model.init_from == ""


def test_a_refused_resume_leaves_the_runs_tokenizer_copy_as_it_was(base, tmp_path,
                                                                   monkeypatch, capsys):
    """The run's copy of its tokenizer was replaced by the base's new one before restore
    refused the resume for that very tokenizer, so sample and export then refused the run
    too. The compile, the memory check and the restore are stood in for: what is tested
    is the order."""
    from jaxmp.train import loop
    from jaxmp.train.checkpoint import CheckpointError

    path, _ = base
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    work = tmp_path / "run"
    work.mkdir()
    (work / "tokenizer.json").write_text("the copy the run was trained with")
    before = (work / "tokenizer.json").read_bytes()

    class Compiled:
        worker = threading.Thread()  # never started: not alive, the compile is done

        def __init__(self, exp):
            pass

        def finish(self, catcher):
            pass

        def join(self, catcher):
            return object()

    def refuse(*args):
        raise CheckpointError("checkpoint step 2 was trained with another tokenizer")

    monkeypatch.setattr(loop, "Compilation", Compiled)
    monkeypatch.setattr(loop, "check_memory", lambda *a: None)
    monkeypatch.setattr(loop, "_restore_or_init", refuse)
    monkeypatch.setattr(loop.Experiment, "check_init_from", lambda self: None)
    config = load_config("configs/finetune.py", [
        f"model.init_from={path}", "data.seq_len=16", "train.batch_size=2",
        f"data.path={tmp_path / 'corpus.txt'}", "train.sample_tokens=0"])
    with pytest.raises(CheckpointError, match="another tokenizer"):
        loop.train_and_evaluate(config, str(work), num_devices=1)
    assert (work / "tokenizer.json").read_bytes() == before
    # A compile still running once the data is read is said (it was silent: about 15 s
    # for a 3-layer DeepSeek-V3 under fp8_blockwise on 2 cores); a finished one is not.
    assert "compiling the train step" not in capsys.readouterr().out
    running = threading.Event()
    Compiled.worker = threading.Thread(target=running.wait, daemon=True)
    Compiled.worker.start()
    try:
        with pytest.raises(CheckpointError, match="another tokenizer"):
            loop.train_and_evaluate(config, str(work), num_devices=1)
    finally:
        running.set()
    assert "compiling the train step ...\n" in capsys.readouterr().out


def test_a_reader_refuses_a_fifo_where_the_runs_tokenizer_copy_belongs(tmp_path):
    """A FIFO there made the readers fall back to the base's tokenizer, silently."""
    from jaxmp.train.tokenizer import kept_tokenizer

    assert kept_tokenizer(tmp_path, "/base/tokenizer.json") is None  # no copy kept
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a regular file; the run's copy "
                                         r"of its tokenizer must be one"):
        kept_tokenizer(tmp_path, "/base/tokenizer.json")


def test_a_billion_layers_are_counted_not_enumerated():
    """parameter_bytes (the memory check's) listed every layer's kind: a config.json of
    10**9 layers took minutes and gigabytes before the refusal."""
    import signal

    from jaxmp.models import ModelConfig
    from jaxmp.train.experiment import parameter_bytes

    def expire(signum, frame):
        raise TimeoutError("still counting after 60 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)  # a bound on a regression, not a timing
    try:
        config = ModelConfig(vocab_size=64, d_model=16, num_layers=10 ** 9, num_heads=2,
                             d_ff=32, num_experts=4, top_k=2, d_expert=8,
                             first_dense_layers=3, mlp_only_layers=(5, 5, 7))
        small = ModelConfig(vocab_size=64, d_model=16, num_layers=10, num_heads=2, d_ff=32,
                            num_experts=4, top_k=2, d_expert=8, first_dense_layers=3,
                            mlp_only_layers=(5, 5, 7))
        big, ten = parameter_bytes(config, "fp32"), parameter_bytes(small, "fp32")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert (config.num_dense_layers, config.num_moe_layers) == (5, 10 ** 9 - 5)
    # the same 5 dense layers; each further layer is one more MoE block
    moe_block = (ten - parameter_bytes(ModelConfig(
        vocab_size=64, d_model=16, num_layers=9, num_heads=2, d_ff=32, num_experts=4, top_k=2,
        d_expert=8, first_dense_layers=3, mlp_only_layers=(5, 5, 7)), "fp32"))
    assert big == ten + (10 ** 9 - 10) * moe_block


def test_the_counted_dense_layers_are_the_enumerated_ones():
    """ModelConfig.num_dense_layers counts what is_moe_layer says layer by layer."""
    from hypothesis import given, settings, strategies as st

    from jaxmp.models import ModelConfig

    @settings(max_examples=60, deadline=None)
    @given(n=st.integers(1, 12), first=st.integers(0, 12), experts=st.sampled_from([0, 4]),
           only=st.lists(st.integers(0, 11), max_size=5))
    def check(n, first, experts, only):
        first = min(first, n)
        only = tuple(i for i in only if i < n)
        c = ModelConfig(vocab_size=64, d_model=16, num_layers=n, num_heads=2, d_ff=32,
                        num_experts=experts, top_k=2, d_expert=8, first_dense_layers=first,
                        mlp_only_layers=only)
        assert c.num_dense_layers == sum(not c.is_moe_layer(i) for i in range(n))

    check()
