"""``python -m distill``: a DSpark draft trained on the tiny target loads, keeps the greedy
invariant, learns (the loss falls), resumes from its checkpoint, and refuses bad options."""
import json

import pytest
import torch
from safetensors import safe_open

import distill.__main__ as cli
import distill.loop as loop
from common.prompts import file_checksum
from distill.draft_init import default_taps
from distill.evaluate import teacher_forced_tau
from distill.loop import learning_rate
from distill.loss import teacher_forced_logits
from distill.options import DistillSpec
from distill.prompts import load_tokenizer
from distill.run import distill
from modeling.pair import load_pair
from modeling.target import from_start
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import PROMPTS

QUESTIONS = ["what is two plus two", "name a color", "count to five", "say hello", "why is the sky blue",
             "add three and four", "spell cat", "list some fruit", "how old is the moon", "tell a joke"]
SMALL = ["--num-prompts", "6", "--eval-prompts", "2", "--max-new-tokens", "24", "--batch-anchors", "16",
         "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny models gain nothing from intra-op threads, and on a busy machine their thread
    barriers cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in QUESTIONS))
    return path


def _distill(target, out, prompts_file, *extra):
    cli.main(["--target", str(target), "--out", str(out), "--prompts", str(prompts_file),
              *SMALL, *extra])


def _assert_greedy_invariant(target_dir, draft_dir):
    target, draft = load_pair(target_dir, draft_dir)
    spec = generate(TorchBackend(target, draft, capacity=96), PROMPTS, max_new_tokens=30,
                    eos_token_ids=target.config.eos_token_ids)
    plain = generate(TorchBackend(target, None, capacity=96), PROMPTS, max_new_tokens=30,
                     eos_token_ids=target.config.eos_token_ids, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.steps > 0 and spec.stats.k == draft.config.block_size
    return draft


def test_distill_writes_a_draft_that_loads_and_keeps_the_greedy_invariant(tiny, prompts_file, tmp_path,
                                                                         capsys):
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    _distill(target_dir, out, prompts_file, "--steps", "6", "--block-size", "3", "--markov-rank", "8")
    printed = capsys.readouterr().out
    assert "steps 6" in printed and "loss" in printed and "tau" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == "vanilla"
    assert config["target_layer_ids"] == [0, 1, 2] and config["num_target_layers"] == 4
    assert config["block_size"] == 3 and config["markov_rank"] == 8 and config["num_hidden_layers"] == 1
    assert config["mask_token_id"] == 0 and "draft_vocab_size" not in config   # the tokenizer's pad id
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16
        assert "embed_tokens.weight" not in f.keys()  # the target's, shared at load time
    draft = _assert_greedy_invariant(target_dir, out)
    assert draft.k == 3
    # what it was trained on, as data beside it: the first 6 of the 10 records (the last 4 held out),
    # the file known by its checksum (python -m bench refuses to measure the draft on them)
    record = json.loads((out / "training.json").read_text())
    assert [(e["file"], e["records"]) for e in record["prompts"]] == [(str(prompts_file), [0, 6])]
    assert record["prompts"][0]["checksum"] == file_checksum(prompts_file)
    # the user's umask decides who may read the draft, as for any file the command writes
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode


def test_the_training_loss_falls(tiny, prompts_file, tmp_path):
    target_dir, _ = tiny()
    spec = DistillSpec(prompts=(prompts_file,), num_prompts=6, eval_prompts=0, max_new_tokens=24,
                       steps=60, lr=3e-3, batch_anchors=16, save_every=60, seed=0, progress=False)
    result = distill(target_dir, tmp_path / "draft", spec)
    losses = result.losses
    assert len(losses) == 60 and result.tau is None
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.7 * first, (first, last)


def test_the_draft_learns_what_the_target_says(tiny, prompts_file, tmp_path):
    """Trained long enough on the target's answers, the draft proposes them: acceptance on the
    training prompts climbs towards block_size + 1, which only happens when the training forward
    is the inference forward (layout, positions, mask, Markov predecessors)."""
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    spec = DistillSpec(prompts=(prompts_file,), num_prompts=6, eval_prompts=0, max_new_tokens=24,
                       steps=300, lr=3e-3, batch_anchors=16, save_every=300, progress=False)
    distill(target_dir, out, spec)
    data = torch.load(out / "data.pt")
    target, draft = load_pair(target_dir, out)
    result = generate(TorchBackend(target, draft, capacity=96), data["prompts"], max_new_tokens=24,
                      eos_token_ids=target.config.eos_token_ids)
    assert result.token_ids == data["continuations"]
    assert result.stats.tau > 3.0
    # the measure --eval-every takes: every generated position an anchor, teacher-forced
    with torch.no_grad():
        sequences = [(torch.tensor(p + c), len(p)) for p, c in zip(data["prompts"], data["continuations"])]
        no_rows = torch.zeros(1, 0, dtype=torch.long)
        tapped = [(tokens, length, from_start(target, tokens[None], no_rows)[1][0])
                  for tokens, length in sequences]
    forced = teacher_forced_tau(draft, tapped, None)
    assert abs(forced - result.stats.tau) < 0.1 * result.stats.tau


def test_rerunning_resumes_from_the_checkpoint(tiny, prompts_file, tmp_path, capsys, monkeypatch):
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    args = ("--steps", "7", "--save-every", "2", "--eval-prompts", "0")
    save = loop.save   # where train() looks it up

    def interrupted_after_step_4(out, draft, optimizer, step, *rest, **options):
        save(out, draft, optimizer, step, *rest, **options)
        if step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save", interrupted_after_step_4)
    with pytest.raises(SystemExit) as exit_info:
        _distill(target_dir, out, prompts_file, *args)
    assert exit_info.value.code == 130   # Ctrl-C: the status of a run stopped by SIGINT
    assert "rerun the same command to resume" in capsys.readouterr().err
    monkeypatch.setattr(loop, "save", save)
    first = torch.load(out / "trainer.pt")
    written = {name: (out / name).stat().st_mtime_ns for name in ("data.pt", "taps.pt")}
    assert first["step"] == 4 and len(first["losses"]) == 4

    def no_target_pass(*_):
        raise AssertionError("the taps were computed again")

    monkeypatch.setattr(loop._TapCache, "_taps", no_target_pass)
    _distill(target_dir, out, prompts_file, *args)
    monkeypatch.undo()
    assert "steps 7 (resumed at 4)" in capsys.readouterr().out
    second = torch.load(out / "trainer.pt")
    assert second["step"] == 7 and second["losses"][:4] == first["losses"] and len(second["losses"]) == 7
    # neither the answers nor the taps are computed again
    assert {name: (out / name).stat().st_mtime_ns for name in written} == written

    # the same draws and learning rates as one uninterrupted run
    straight = tmp_path / "straight"
    _distill(target_dir, straight, prompts_file, *args)
    assert torch.load(straight / "trainer.pt")["losses"] == pytest.approx(second["losses"], rel=1e-4)

    with pytest.raises(SystemExit, match="holds a run with --block-size 4, not 5"):
        _distill(target_dir, out, prompts_file, "--steps", "8", "--block-size", "5")
    assert json.loads((out / "config.json").read_text())["block_size"] == 4   # left as it was
    assert torch.load(out / "trainer.pt")["step"] == 7

    # another model on the same data reuses data.pt and taps.pt, unless it reads other taps
    other = tmp_path / "other"
    other.mkdir()
    for name in ("data.pt", "taps.pt"):
        (other / name).hardlink_to(out / name)
    with pytest.raises(SystemExit, match="holds a run with --taps \\[0, 1, 2\\], not \\[0, 2\\]"):
        _distill(target_dir, other, prompts_file, *args, "--taps", "0,2")


def test_answers_and_taps_through_an_engine_are_the_targets(tiny, engine_dir, prompts_file, tmp_path):
    """``--engine``: the greedy answers are the target's own (the engine's float32 target equals
    the PyTorch one token for token), ``--samples`` adds answers sampled at T = 1, and the taps
    the draft trains on are the engine's, teacher-forced in chunks, equal to the PyTorch target's
    within float32 rounding. An engine of another target is refused in one line."""
    from common import manifest
    from distill import engine as engine_target
    from modeling.target import from_start, load_target

    from conftest import CLI_LIMITS, LIMITS

    engine = engine_dir(LIMITS)      # chunks of 8: taps in several calls
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    _distill(target_dir, out, prompts_file, "--engine", str(engine), "--samples", "1", "--steps", "2",
             "--eval-prompts", "0")
    data = torch.load(out / "data.pt")
    prompts, answers = data["prompts"], data["continuations"]
    assert len(answers) == 2 * 6 and prompts[:6] == prompts[6:]
    taps = json.loads((out / "config.json").read_text())["target_layer_ids"]   # the engine's, not the default
    assert taps == manifest.read(engine)["draft"]["target_layer_ids"] != list(default_taps(4))
    target, _ = load_pair(target_dir, None)
    greedy = generate(TorchBackend(target, None, capacity=96), prompts[:6], max_new_tokens=24,
                      eos_token_ids=target.config.eos_token_ids, speculative=False)
    assert answers[:6] == greedy.token_ids
    assert answers[6:] != answers[:6] and data["generation"]["tokens"] == sum(map(len, answers))

    backend = engine_target.open_engine(engine, target_dir, None)
    backend.start(1)
    sequence = torch.tensor(prompts[0] + answers[0])
    assert sequence.numel() > 2 * LIMITS.max_prompt_chunk
    taps = engine_target.taps(backend, sequence)
    tapped = load_target(target_dir, taps=tuple(backend.manifest["draft"]["target_layer_ids"]))
    with torch.no_grad():
        expected = from_start(tapped, sequence[None], torch.zeros(1, 0, dtype=torch.long))[1][0]
    torch.testing.assert_close(taps, expected, rtol=1e-4, atol=1e-4)

    other = engine_dir(CLI_LIMITS, arch="llama")
    with pytest.raises(SystemExit, match=f"--engine {other}: built from another target than --target"):
        _distill(target_dir, tmp_path / "other", prompts_file, "--engine", str(other))
    with pytest.raises(SystemExit, match=f"--engine {engine}: its draft reads target layers .*; "
                                         f"--taps 0,1"):
        _distill(target_dir, tmp_path / "taps", prompts_file, "--engine", str(engine), "--taps", "0,1")


def test_synthetic_prompts_and_follow_ups_are_the_targets_own(tiny, prompts_file, tmp_path):
    """``--synthetic 3 --follow-ups``: prompts the target wrote from the training records (none a
    record of the file), then a second turn on every greedy answer (a generic follow-up, the file's
    records having one turn), answered greedily by the target too."""
    from distill import synthetic

    target_dir, _ = tiny()
    out = tmp_path / "draft"
    _distill(target_dir, out, prompts_file, "--synthetic", "3", "--follow-ups", "--steps", "1",
             "--eval-prompts", "0")
    data = torch.load(out / "data.pt")
    firsts = len(data["prompts"]) // 2
    assert len(data["prompts"]) == 2 * firsts and 6 <= firsts <= 6 + 3
    tokenizer = load_tokenizer(target_dir)
    texts = [tokenizer.decode(ids) for ids in data["prompts"]]
    assert all(not any(question in text for question in QUESTIONS) for text in texts[6:firsts])
    for index in range(firsts):
        conversation = texts[firsts + index]
        assert texts[index].rsplit("assistant", 1)[0] in conversation
        assert synthetic.FOLLOW_UPS[index % len(synthetic.FOLLOW_UPS)] in conversation
    target, _ = load_pair(target_dir, None)
    greedy = generate(TorchBackend(target, None, capacity=256), data["prompts"][firsts:], max_new_tokens=24,
                      eos_token_ids=target.config.eos_token_ids, speculative=False)
    assert greedy.token_ids == data["continuations"][firsts:]


def test_the_best_evaluated_draft_is_kept_and_patience_stops_the_run(tiny, prompts_file, tmp_path, capsys,
                                                                     monkeypatch):
    """``--eval-every 2 --patience 2``: each file's held-out acceptance is measured every 2 steps;
    OUT's draft is the one of the best evaluation (here step 4 of scripted measures), the run
    stops 2 evaluations after it, and a rerun resumes no further."""
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    scripted = iter([1.1, 1.3, 1.2, 1.25, 1.0, 1.0])   # per evaluation: step 2, 4, 6, 8, ...
    measured = []

    def measure(draft, sequences, kept):
        measured.append(len(sequences))
        return next(scripted)

    drafts = {}
    save = loop.save

    def keep(out, draft, optimizer, step, *rest, **options):
        drafts[step] = {name: t.half() for name, t in draft.state_dict().items()}
        save(out, draft, optimizer, step, *rest, **options)

    monkeypatch.setattr(loop, "teacher_forced_tau", measure)
    monkeypatch.setattr(loop, "save", keep)
    args = ("--steps", "20", "--eval-every", "2", "--patience", "2", "--eval-prompts", "2",
            "--save-every", "3")
    _distill(target_dir, out, prompts_file, *args)
    printed = capsys.readouterr().out
    evals = torch.load(out / "trainer.pt")["evals"]
    assert [e["step"] for e in evals] == [2, 4, 6, 8] and torch.load(out / "trainer.pt")["step"] == 8
    assert set(evals[0]["tau"]) == {"prompts"} and measured[0] == 2
    assert "the draft of step 4, the best of 4 evaluations, stopped after 2" in printed
    assert "teacher-forced held-out tau: prompts 1.300" in printed
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert all(torch.equal(f.get_tensor(name), drafts[4][name]) for name in f.keys())
    assert sorted(drafts) == [2, 3, 4, 6, 8]      # the evaluations' steps and --save-every's
    _distill(target_dir, out, prompts_file, *args)
    assert "steps 8 (resumed at 8)" in capsys.readouterr().out and len(measured) == 4


def test_reduced_vocabulary(tiny, prompts_file, tmp_path):
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    _distill(target_dir, out, prompts_file, "--steps", "4", "--draft-vocab", "20", "--mask-token-id", "2",
             "--loss-decay", "2", "--eval-prompts", "0")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 20 and config["mask_token_id"] == 2
    with safe_open(out / "model.safetensors", framework="pt") as f:
        d2t, lm_head = f.get_tensor("d2t"), f.get_tensor("lm_head.weight")
        assert d2t.dtype == torch.int64 and d2t.shape == (20,) and lm_head.shape == (20, 64)
        assert f.get_tensor("markov_head.markov_w2.weight").shape == (20, 32)
    kept = torch.arange(20) + d2t
    assert 2 in kept.tolist() and kept.unique().numel() == 20
    target, _ = load_pair(target_dir, out)
    assert torch.allclose(lm_head.float(), target.lm_head.weight[kept], atol=1e-2)  # the target's rows
    draft = _assert_greedy_invariant(target_dir, out)
    assert draft.config.draft_vocab_size == 20


@pytest.mark.parametrize("case, message", [
    (["--steps", "0"], "--steps 0: expected at least 1"),
    (["--block-size", "1"], "--block-size 1: expected at least 2"),
    (["--lr", "0"], "--lr 0.0: expected a positive number"),
    (["--taps", "2,1"], "--taps 2,1: expected strictly increasing"),
    (["--taps", "0,3"], "--taps 0,3: layer 3 is outside -1..2"),
    (["--held-out", "10"], "holds 10 prompts; --held-out 10 leaves none to train on"),
    (["--eval-prompts", "5"], "--eval-prompts 5: expected at most --held-out 4"),
    (["--draft-vocab", "85"], "--draft-vocab 85: expected fewer than the target's 85"),
    (["--init-layer", "4"], "--init-layer 4: expected 0..3 or -4..-1 .* or 'random'"),
    (["--init-layer", "0", "--layers", "2"], "--init-layer 0: expected 1..3 or -3..-1 .* 2-layer draft"),
    (["--eval-every", "5", "--eval-prompts", "0"], "--eval-every 5: needs --eval-prompts"),
    (["--patience", "3"], "--patience 3: needs --eval-every"),
    (["--samples", "-1"], "--samples -1: expected at least 0"),
    (["--engine", "nowhere"], "--engine nowhere: no such directory"),
])
def test_bad_options_are_refused(tiny, prompts_file, tmp_path, case, message):
    with pytest.raises(SystemExit, match=message):
        _distill(tiny()[0], tmp_path / "draft", prompts_file, *case)


def test_a_gemma4_target_is_refused_in_one_line(tiny, prompts_file, tmp_path):
    """Its draft is DeepSpec's Gemma4DSparkModel, which distill does not train."""
    with pytest.raises(SystemExit, match="a Gemma4ForConditionalGeneration target's draft is a "
                                         "Gemma4DSparkModel, which distill does not train yet"):
        _distill(tiny(arch="gemma4-multimodal")[0], tmp_path / "draft", prompts_file)


@pytest.mark.parametrize("options, sources", [([], [3]), (["--init-layer", "-2", "--layers", "2"], [1, 2]),
                                              (["--init-layer", "random"], [])])
def test_draft_layers_start_from_the_targets_last_ones(tiny, prompts_file, tmp_path, options, sources):
    """The saved draft after one step at a negligible learning rate is its initial weights."""
    target_dir, _ = tiny()
    out = tmp_path / "draft"
    _distill(target_dir, out, prompts_file, "--steps", "1", "--lr", "1e-12", "--eval-prompts", "0", *options)
    target, draft = load_pair(target_dir, out)
    for index, layer in enumerate(draft.layers):
        source = target.layers[sources[index] if sources else -1].state_dict()
        same = {name: torch.allclose(weight, source[name], atol=1e-3)
                for name, weight in layer.state_dict().items()}
        projections = [same[name] for name in same if name.endswith("proj.weight")]
        assert len(projections) == 7
        assert all(same.values()) if sources else not any(projections)


def test_a_non_empty_out_is_refused_without_force(tiny, prompts_file, tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        _distill(tiny()[0], tmp_path, prompts_file, "--steps", "1")
    assert (tmp_path / "keep.txt").read_text() == "user data"
    with pytest.raises(SystemExit, match="--prompts .*missing.jsonl: no such file"):
        _distill(tiny()[0], tmp_path / "x", tmp_path / "missing.jsonl")


def test_default_taps_follow_the_released_spread():
    assert default_taps(36) == (1, 17, 33)
    assert default_taps(36, count=5) == (1, 9, 17, 25, 33)
    assert default_taps(4) == (0, 1, 2)       # too few layers for 1..N-3: every layer but the final
    assert default_taps(2) == (-1, 0)


@pytest.mark.parametrize("vocab", [None, 40])
def test_training_forward_matches_the_inference_forward(tiny, vocab):
    """All anchors in one masked pass == ``DraftStep``'s context + block forward per anchor, plus
    the Markov bias of the true predecessors."""
    target, draft = load_pair(*tiny(draft_vocab=vocab))
    tokens = torch.tensor(PROMPTS[2] + PROMPTS[0])
    _, aux, *_ = target(tokens[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long),
                        *target.empty_cache(1, 32))
    anchors = torch.tensor([3, 7, 11, 14])
    logits, labels = teacher_forced_logits(draft, aux[0], tokens, anchors)
    block = draft.config.block_size
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    for i, p in enumerate(anchors.tolist()):
        cache = draft.write_context(aux[:, :p], torch.zeros(1, dtype=torch.long), *draft.empty_cache(1, 32))
        base = draft.block_logits(tokens[p:p + 1], torch.tensor([p]), *cache)[0][0]
        expected = base + w1[tokens[p:p + block]] @ w2.T
        assert torch.allclose(logits[i], expected, atol=1e-4)
        truth = tokens[p + 1:p + block + 1].tolist()
        assert labels[i].tolist() == truth + [-100] * (block - len(truth))


def test_learning_rate_warms_up_then_decays_to_a_tenth(prompts_file):
    spec = DistillSpec(prompts=(prompts_file,), steps=100, lr=1e-3, warmup=10)
    rates = [learning_rate(spec, step) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3, rel=0.03)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))          # never rises after warm-up
    assert learning_rate(spec, 100) == pytest.approx(1e-4)
