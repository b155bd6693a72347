"""Where do the EAGLE head's training metric and its decoding acceptance part ways?

On the default model (native runtime) and a few of the model's own greedy answers to
bench prompts, this computes per answer position n (context = tokens[:n], the head must
guess token n, which greedy decoding makes the target's argmax):

(a) teacher-forced: the head's top-1 exactly as ``trainer.evaluate`` computes the held-out
    metric (``predictions`` over one teacher-forced forward; row n - 2 predicts token n);
(b) drafting: the drafter's first draft token given the context, through the target's
    session (what the engine does), and the first-draft acceptance of a real greedy run;

and compares the inputs the head sees in both (features, token ids, positions).
With --sources it only computes the training's held-out metric on kinds of text (bench
answers, self-distillation answers, topic prompts seen or unseen in training, the
documentation records), to see which text the held-out figure stands for.

    PYTHONPATH=src .venv/bin/python scripts/diagnose_head.py --prompts 6 --max-new-tokens 64
    PYTHONPATH=src .venv/bin/python scripts/diagnose_head.py --prompts 8 --max-new-tokens 64 \
        --sources bench selfdistill seentopics newtopics docs

Findings: docs/heads-diagnosis.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculative.bench.prompts import load_prompts
from speculative.drafters.eagle import EagleDrafter
from speculative.drafters.registry import build_drafter
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.models.session import ModelSession
from speculative.sampling import SamplingParams
from speculative.targets import encode_prompt, load_target
from speculative.training.features import Sequence_
from speculative.training.trainer import collate, predictions


@dataclass
class Recorder:
    """Wraps an EAGLE runner's ``step`` to keep what the head was fed."""

    runner: object
    calls: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.runner.step

        def step(embeds, features, positions, mask=None):
            self.calls.append(
                {"embeds": embeds.clone(), "features": features.clone(), "positions": positions}
            )
            return inner(embeds, features, positions, mask)

        self.runner.step = step


CATEGORIES = ("multi_turn_chat", "question_answering")
GREEDY = SamplingParams(temperature=0.0)


def run(target, drafter, prompt_ids: list[int], max_new: int, gamma: int = 3):
    """A greedy generation (plain decoding when ``drafter`` is None)."""
    engine = SpeculativeEngine(target.lm, drafter, gamma)
    stop = StopCriteria(max_new_tokens=max_new)
    return engine.generate(prompt_ids, GREEDY, stop, torch.Generator().manual_seed(0))


def teacher_forced_guesses(drafter: EagleDrafter, lm, tokens: Sequence[int]):
    """Per row t: the head's top-1 (target id) for token t + 2, as the held-out metric
    computes it; plus the teacher-forced features and greedy tokens."""
    lm.reset()
    logits, features = lm.forward_with_hidden(torch.tensor([list(tokens)]))
    lm.reset()
    item = Sequence_(torch.tensor(tokens), features[0].float(), logits[0].argmax(-1))
    head = drafter.head
    with torch.no_grad():
        pred, offset = predictions(head.module, collate([item]), head.embedding, 1)[0]
    assert offset == 1
    ids = head.draft_to_target[(pred[0] @ head.head_rows.T).argmax(-1)]  # [L - 1]
    return ids, features[0], item.greedy


def drafted_guesses(drafter: EagleDrafter, target, tokens: Sequence[int], start: int):
    """Per context length n >= start: the drafter's first greedy draft, from a session
    that scored the context (as the engine's verify pass leaves it)."""
    session = ModelSession(target.lm)
    drafter.reset()
    drafter.prime(session)
    recorder = Recorder(drafter.chain.runner)
    generator = torch.Generator().manual_seed(0)
    guesses, fed = {}, {}
    for n in range(start, len(tokens)):
        session.logits_after(tokens[:n])
        recorder.calls.clear()
        draft = drafter.propose(tokens[:n], 1, GREEDY, generator)
        guesses[n] = draft.tokens[0]
        fed[n] = list(recorder.calls)
    return guesses, fed, session


def held_out_metric(drafter: EagleDrafter, target, sequences: list[list[int]], folder: Path):
    """The training's held-out metric (``trainer.evaluate``, answers only) on ``sequences``."""
    from speculative.training.features import chunk_paths, extract
    from speculative.training.train_draft import turn_marker
    from speculative.training.trainer import evaluate

    head = drafter.head
    extract(target.lm, [(tokens, True) for tokens in sequences], folder, progress=False)
    paths = chunk_paths(folder, "heldout")
    marker = turn_marker(target.tokenizer)
    return evaluate(
        head.module, paths, head.embedding, head.head_rows, head.draft_to_target, 5, marker
    )


def source_sequences(target, source: str, count: int, max_new: int) -> list[list[int]]:
    """Token sequences like the training's, chat-templated as training does: bench chat/QA
    answers (``bench``); answers to the self-distillation prompts (``selfdistill``), to
    its topic templates over topics it never saw (``newtopics``) or over its own topics
    (``seentopics``); or the documentation / code records of prepare_draft_data.py
    (``docs``)."""
    from speculative.training.data import encode_record

    if source == "docs":
        sys.path.insert(0, str(Path(__file__).parent))
        import prepare_draft_data as prep

        from speculative.training.prompts import code_snippets

        docs = prep.read_texts(f"{prep.DOC_SOURCES}/**/*.txt", 2000)
        code = code_snippets(prep.read_texts(f"{prep.PY_SOURCES}/*.py", 400))
        records = prep.doc_records(docs, code, seed=1)[:count]  # another seed: unseen order
        return [encode_record(target.tokenizer, r, 512) for r in records]
    if source == "bench":
        bench = [p for p in load_prompts() if p.category in CATEGORIES]
        chats = [
            list(p.messages) if p.messages else [{"role": "user", "content": p.prompt}]
            for p in bench
        ]
        chats = chats[: (count + 1) // 2] + chats[len(chats) // 2 :][: count // 2]
    elif source == "newtopics":  # the training's topic templates over unseen topics
        from speculative.training.prompts import eval_prompts

        chats = eval_prompts(count)
    elif source == "seentopics":  # the same construction over the training's topics
        from speculative.training.prompts import TOPICS, eval_prompts

        chats = eval_prompts(count, TOPICS)
    else:
        from speculative.training.prompts import build_prompts

        chats = build_prompts(count, seed=12345)
    out = []
    for messages in chats:
        prompt_ids = encode_prompt(target.tokenizer, None, messages)
        answer = list(run(target, None, prompt_ids, max_new).token_ids)
        text = target.tokenizer.decode(answer, skip_special_tokens=True)
        record = {"messages": [*messages, {"role": "assistant", "content": text}]}
        out.append(encode_record(target.tokenizer, record, 512))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="chat + qa prompts (half each)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--draft", default="eagle", help="eagle or eagle:DIR")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--sources",
        nargs="*",
        default=None,
        choices=("bench", "selfdistill", "seentopics", "newtopics", "docs"),
        help="only the training's held-out metric on these kinds of text",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("default", "native", args.precision)
    drafter = build_drafter(args.draft, target)
    assert isinstance(drafter, EagleDrafter)
    if args.sources is not None:
        report = {}
        for source in args.sources:
            sequences = source_sequences(target, source, args.prompts, args.max_new_tokens)
            with tempfile.TemporaryDirectory() as folder:
                held = held_out_metric(drafter, target, sequences, Path(folder))
            report[source] = {
                "top1": held.top1,
                "accepted_of_5": held.accepted,
                "tokens": held.tokens,
            }
        print(json.dumps(report, indent=1))
        return
    prompts = [p for p in load_prompts() if p.category in CATEGORIES]
    chosen = [p for p in prompts if p.category == "multi_turn_chat"][: (args.prompts + 1) // 2]
    chosen += [p for p in prompts if p.category == "question_answering"][: args.prompts // 2]
    totals = {"tf": 0, "draft": 0, "same": 0, "n": 0, "run_first_acc": 0, "run_rounds": 0}
    feature_gap, worst_inputs = 0.0, []
    for prompt in chosen:
        messages = list(prompt.messages) if prompt.messages else None
        prompt_ids = encode_prompt(target.tokenizer, prompt.prompt, messages)
        answer = list(run(target, None, prompt_ids, args.max_new_tokens).token_ids)
        tokens = prompt_ids + answer
        tf_ids, tf_features, tf_greedy = teacher_forced_guesses(drafter, target.lm, tokens)
        agree = tf_greedy[len(prompt_ids) - 1 : -1].tolist() == answer
        totals["tf_greedy_is_answer"] = totals.get("tf_greedy_is_answer", 0) + agree
        guesses, fed, _session = drafted_guesses(drafter, target, tokens, len(prompt_ids))
        for n in range(len(prompt_ids), len(tokens)):
            want = tokens[n]  # the target's greedy token n
            tf = int(tf_ids[n - 2])
            totals["tf"] += tf == want
            totals["draft"] += guesses[n] == want
            totals["same"] += guesses[n] == tf
            totals["n"] += 1
            # the inputs: the last pair the drafter fed before its guess
            last = fed[n][-1]
            t = int(last["positions"][-1])
            gap = float((last["features"][-1] - tf_features[t]).abs().max())
            embed_ok = torch.equal(last["embeds"][-1], drafter.head.embedding[tokens[t + 1]])
            feature_gap = max(feature_gap, gap)
            if len(worst_inputs) < 3 and (t != n - 2 or not embed_ok):
                worst_inputs.append({"n": n, "last_pair_position": t, "embed_ok": embed_ok})
        # a real greedy run with the drafter: first-draft acceptance per round
        out = run(target, drafter, prompt_ids, args.max_new_tokens)
        assert list(out.token_ids) == answer  # lossless
        positions = out.stats.positions
        totals["run_first_acc"] += positions.accepted[0] if positions.reached else 0
        totals["run_rounds"] += positions.reached[0] if positions.reached else 0
    n = max(totals["n"], 1)
    report = {
        "target_precision": target.precision,
        "positions": totals["n"],
        "teacher_forced_top1": totals["tf"] / n,
        "drafter_first_token_agreement": totals["draft"] / n,
        "drafter_equals_teacher_forced": totals["same"] / n,
        "real_run_first_draft_acceptance": totals["run_first_acc"] / max(totals["run_rounds"], 1),
        "max_feature_gap_session_vs_teacher_forced": feature_gap,
        "misaligned_inputs": worst_inputs,
        "prompts_whose_teacher_forced_argmax_is_the_answer": totals.get("tf_greedy_is_answer"),
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            print(f"{key:45s} {value}")


if __name__ == "__main__":
    main()
