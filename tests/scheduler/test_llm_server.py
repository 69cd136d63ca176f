"""An in-process `LLM` served over real HTTP through `ModelRuntime.from_llm` (the notebooks'
server): the answers are the LLM's own, nothing compiles, and stopping the server leaves the
LLM serving."""

from __future__ import annotations

from metrale_jax import SamplingParams


def test_a_server_on_the_llm_answers_with_its_tokens_and_leaves_it_running(tiny_llm):
    from openai import OpenAI

    from serving.http.runtime import ModelRuntime
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings

    prompt = "the quick brown fox"
    greedy = SamplingParams(max_tokens=8, temperature=0)
    want = tiny_llm.generate([prompt], greedy)[0]
    engine = tiny_llm.scheduler.engine
    compiled = engine.compile_count
    settings = ServerSettings(model="tiny", port=0, warmup="full")
    with ServerThread(settings, runtime=ModelRuntime.from_llm(tiny_llm, settings)) as server:
        assert server.wait_ready(timeout=60)
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
    assert tiny_llm.scheduler.engine is engine and engine.compile_count == compiled
    again = tiny_llm.generate([prompt], greedy)[0]
    assert again.token_ids == want.token_ids
