"""router_samples: a request of n samples split into n requests of one, and their answers merged into the one a
unified server gives (the end-to-end run through a real router is tests/disagg/test_pd_e2e.py)."""
import asyncio
import json

from specpd.disagg.router_samples import child_bodies, merge_bodies, merge_streams, samples


def test_split_only_integers_above_one_with_seeds_per_sample():
    assert [samples({"n": v}) for v in (None, 1, 2, True, "3", 2.0)] == [None, None, 2, None, None, None]
    bodies = child_bodies({"prompt": "x", "n": 3, "seed": 2 ** 64 - 2}, 3)
    assert [b["n"] for b in bodies] == [1, 1, 1]
    assert [b["seed"] for b in bodies] == [2 ** 64 - 2, -(2 ** 63) + 2 ** 63 - 1, -(2 ** 63) + 2 ** 63]  # wrapped
    assert "seed" not in child_bodies({"prompt": "x"}, 2)[1]


def _usage(completion, verify, tau):
    return {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion,
            "spec_verify_count": verify, "spec_accepted_tokens": 1, "spec_accept_length": tau}


def test_bodies_merge_under_their_indexes_with_the_prompt_once():
    bodies = [{"id": f"c{i}", "choices": [{"index": 0, "text": t}], "usage": _usage(4, 2, 2.0)}
              for i, t in enumerate("ab")]
    merged = merge_bodies(bodies)
    assert merged["id"] == "c0" and [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b")]
    assert (merged["usage"]["prompt_tokens"], merged["usage"]["completion_tokens"],
            merged["usage"]["total_tokens"], merged["usage"]["spec_accept_length"]) == (5, 8, 13, 2.0)


async def _chunks(events: list[str], cut: int):
    """An SSE stream cut into pieces of `cut` bytes, mid-event."""
    data = "".join(f"data: {e}\n\n" for e in events).encode()
    for k in range(0, len(data), cut):
        await asyncio.sleep(0)
        yield data[k:k + cut]


def test_streams_merge_under_their_indexes_usage_last_and_one_done():
    def events(text):
        return [json.dumps({"id": "x", "choices": [{"index": 0, "text": c}], "usage": None}) for c in text] + [
            json.dumps({"id": "x", "choices": [], "usage": _usage(len(text), 1, 3.0)}), "[DONE]"]

    async def run():
        return [e async for e in merge_streams([_chunks(events("abc"), 7), _chunks(events("de"), 5)])]
    out = [e.decode().removeprefix("data: ").strip() for e in asyncio.run(run())]
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    usage = json.loads(out[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    texts = {0: "", 1: ""}
    for e in out[:-2]:
        choice = json.loads(e)["choices"][0]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "abc", 1: "de"}
