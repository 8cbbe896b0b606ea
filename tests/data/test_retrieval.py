"""The embedded retrieval task: a deterministic world and corpus, splits fixed by the entity,
demonstrations that call the search tool (some imperfect), and its exact-match verifier."""

import random

import pytest

from grpolab.data import get_task
from grpolab.data.tasks import RetrievalTask, retrieval_reward_fn, split_of
from grpolab.envs import build_env, load_corpus, replay_demonstrations
from grpolab.models.tiny import CHARACTERS, build_char_tokenizer


def test_world_and_corpus_are_deterministic_per_seed(tmp_path):
    a, b, c = RetrievalTask(seed=0), RetrievalTask(seed=0), RetrievalTask(seed=1)
    assert a.world == b.world and a.world != c.world
    assert len(a.corpus()) == 3 * a.num_entities == len(set(a.corpus()))
    path = a.write_corpus(tmp_path / "corpus.jsonl")
    assert load_corpus(path) == a.corpus()
    values = [v for facts in a.world.values() for v in facts.values()]
    names = list(a.world) + values
    assert len(names) == len(set(names))  # every invented name is unique in the world
    # fixed shapes: the copy distances never change (what lets the tiny model learn to copy)
    assert all(len(e) == 4 and e.isalpha() for e in a.world) and all(len(v) == 5 and v.isalpha() for v in values)
    assert a.corpus()[0] == f"{next(iter(a.world))} ruler: {a.world[next(iter(a.world))]['ruler']}"
    assert all(set(t) <= set(CHARACTERS) for t in a.corpus())  # the char-level tokenizer reads every passage


def test_splits_are_fixed_by_the_entity_and_never_share_one():
    task = get_task("retrieval", seed=0)
    by_split = {s: task.examples(s, 200) for s in ("train", "validation", "test")}
    entities = {s: {e.meta["entity"] for e in ex} for s, ex in by_split.items()}
    assert not entities["train"] & entities["test"] and not entities["validation"] & entities["test"]
    assert all(split_of(e.meta["entity"]) == s for s, ex in by_split.items() for e in ex)
    other_seed = get_task("retrieval", seed=0, wrong_fraction=0.5)  # the split does not depend on the demos
    assert [e.question for e in other_seed.examples("test", 200)] == [e.question for e in by_split["test"]]
    assert [e.question for e in task.examples("test", 50)] == [e.question for e in by_split["test"][:50]]
    assert [e.meta["source"] for e in by_split["test"][:2]] == ["task:retrieval:test:0", "task:retrieval:test:1"]


def test_demonstrations_call_the_tool_and_copy_the_answer_from_the_result(tmp_path):
    task = RetrievalTask(seed=0, wrong_fraction=0.0)
    env = build_env(["search"], corpus=str(task.write_corpus(tmp_path / "c.jsonl")), top_k=1)
    examples = task.examples("train", 100)
    for e in examples:
        assert e.solution.startswith(f"<search>{e.meta['query']}</search><result>{e.meta['passage']}</result>")
        assert e.meta["entity"] in e.question and e.answer in e.meta["passage"]
        assert retrieval_reward_fn(e.solution, e.answer)["reward"] == 1.0
    tok = build_char_tokenizer()
    demos = replay_demonstrations(env, tok, [e.question for e in examples], [e.solution for e in examples])
    assert [d.text for d in demos] == [e.solution for e in examples]  # the live top-1 search returns the gold passage
    assert all(d.tool_calls == 1 and False in d.loss_mask for d in demos)


@pytest.mark.parametrize("kind", ["typo", "search", "answer", "mixed"])
def test_imperfect_demonstrations_are_wrong_in_the_stated_way(kind):
    task = RetrievalTask(seed=0, wrong_fraction=0.5, wrong_kind=kind)
    examples = task.examples("train", 400)
    wrong = [e for e in examples if not e.meta["solution_correct"]]
    assert 0.4 < len(wrong) / len(examples) < 0.6
    assert all(retrieval_reward_fn(e.solution, e.answer)["reward"] == (1.0 if e.meta["solution_correct"] else 0.0)
               for e in examples)
    bad_search = [e for e in wrong if f"<search>{e.meta['query']}</search>" not in e.solution]
    bad_answer = [e for e in wrong if f"<search>{e.meta['query']}</search>" in e.solution]
    assert {"search": (len(wrong), 0), "answer": (0, len(wrong)), "typo": (0, len(wrong))}.get(
        kind, (len(bad_search), len(bad_answer))) == (len(bad_search), len(bad_answer))
    answered = {id(e): e.solution.split("<answer>")[1].split("</answer>")[0] for e in bad_answer}
    typos = [e for e in bad_answer if _letters_changed(answered[id(e)], e.answer) == 1]
    assert len(typos) == {"typo": len(wrong), "answer": 0}.get(kind, len(typos))  # an invented name differs more
    if kind == "mixed":
        assert bad_search and typos and len(typos) < len(bad_answer)
    for e in bad_search:  # the answer is copied from the passage of the entity searched for
        searched = e.solution.split("<search>")[1].split(" ")[0]
        assert searched != e.meta["entity"]
        assert task.world[searched][e.meta["relation"]] in e.solution.split("<answer>")[1]
    assert task.wrong_solution(examples[0], random.Random(0)) != examples[0].solution


def _letters_changed(a: str, b: str) -> int:
    return len(a) - len(b) + sum(x != y for x, y in zip(a, b)) if len(a) >= len(b) else _letters_changed(b, a)


def test_verifier_is_exact_match_after_normalisation():
    ok = "<search>x</search><result>y</result></think> <answer> velmora. </answer>"
    assert retrieval_reward_fn(ok, "Velmora") == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
    assert retrieval_reward_fn(ok.replace("velmora", "velmoran"), "Velmora")["reward"] == 0.0
    assert retrieval_reward_fn("<answer>Velmora</answer>", "Velmora")["format_reward"] == 0.0
    assert retrieval_reward_fn("</think> <answer>1742</answer>", 1742)["reward"] == 1.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="wrong_kind"):
        RetrievalTask(wrong_kind="step")
    with pytest.raises(ValueError, match="relations"):
        RetrievalTask(relations="capital,weather")
    with pytest.raises(ValueError, match="num_entities"):
        RetrievalTask(num_entities=5)
    with pytest.raises(ValueError, match="fewer than"):
        RetrievalTask(num_entities=10).examples("test", 500)
