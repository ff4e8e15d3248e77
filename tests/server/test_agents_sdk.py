"""A real agent loop: the OpenAI Agents SDK's basic function-tool example (an agent with one
``@function_tool``, ``Runner.run``) against ``pagedllm serve`` unchanged, through both of the
SDK's model back ends (the Responses API, its default, and chat completions). The model is
asked to call the tool (``tool_choice="required"``; the SDK resets it to ``auto`` after the
call, as it does against OpenAI), the tool runs with arguments parsed from the reply, its
result goes back in the next turn and the agent ends with a text answer."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import LiveServer

agents = pytest.importorskip("agents")
pytest.importorskip("xgrammar")


@pytest.mark.parametrize("backend", ["responses", "chat_completions"])
def test_function_tool_agent_loop(server: LiveServer, backend: str) -> None:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def run() -> agents.RunResult:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        model_cls = (agents.OpenAIResponsesModel if backend == "responses"
                     else agents.OpenAIChatCompletionsModel)  # fmt: skip
        agent = agents.Agent(
            name="Assistant",
            instructions="You are a helpful assistant.",
            tools=[get_weather],
            model=model_cls(model=server.model, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=150,
                                                temperature=0),
        )  # fmt: skip
        return await agents.Runner.run(agent, "What is the weather in Tokyo?", max_turns=4)

    result = asyncio.run(run())
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert kinds[-1] == "MessageOutputItem"
    assert len(cities) == 1 and cities[0]  # the tool ran once, with a parsed argument
    assert isinstance(result.final_output, str) and result.final_output
