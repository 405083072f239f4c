"""router.responses_input: the Responses API input as chat messages (as router and worker both
render it), and response ids that name a worker (a pinned value: the contract in docs/contracts.md)."""

from __future__ import annotations

import pytest

from router.responses_input import input_messages, new_response_id, prompt_messages, tag_of, worker_tag


def test_worker_tag_is_pinned_and_ignores_a_trailing_slash() -> None:
    assert worker_tag("http://10.0.0.5:8001") == "aaf1955667"  # mmh3 x64-128, first half, 40 bits
    assert worker_tag("http://10.0.0.5:8001/") == "aaf1955667"
    assert worker_tag("http://10.0.0.6:8001") != "aaf1955667"


def test_response_ids_carry_the_tag_and_nothing_else_parses_as_ours() -> None:
    rid = new_response_id("aaf1955667")
    assert rid.startswith("resp_aaf1955667") and len(rid) == len("resp_") + 10 + 32
    assert tag_of(rid) == "aaf1955667" and new_response_id("aaf1955667") != rid
    for other in ("resp_XYZ", "resp_123", "chatcmpl-aaf1955667", 42, None, "resp_AAF1955667ff"):
        assert tag_of(other) is None


def test_input_becomes_chat_messages() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]


def test_instructions_come_first_then_history_then_input() -> None:
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert prompt_messages("sys", history, "q2") == [
        {"role": "system", "content": "sys"}, *history, {"role": "user", "content": "q2"}
    ]  # fmt: skip
    assert prompt_messages(None, [], "q") == [{"role": "user", "content": "q"}]


@pytest.mark.parametrize(
    "input_",
    ["", [], None, 5, [5], [{"type": "function_call_output", "output": "1"}], [{"role": "tool", "content": "x"}],
     [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], [{"role": "user", "content": 3}],
     [{"role": ["user"], "content": "hi"}], [{"role": {"r": 1}, "content": "hi"}]],
)  # fmt: skip
def test_unsupported_input_is_a_value_error(input_) -> None:
    with pytest.raises(ValueError):
        input_messages(input_)
    with pytest.raises(ValueError):
        prompt_messages(3, [], "q")


def test_function_calls_and_their_outputs_become_tool_turns() -> None:
    from router.responses_input import chat_tool_choice, chat_tools

    items = [
        {"role": "user", "content": "2+3 and 4+5?"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":4,"b":5}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": "9"},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "2+3 and 4+5?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a":4,"b":5}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "9"},
    ]  # fmt: skip
    tool = {"type": "function", "name": "add", "description": "a+b", "parameters": {"type": "object"}}
    assert chat_tools([tool]) == [
        {
            "type": "function",
            "function": {"name": "add", "description": "a+b", "parameters": {"type": "object"}},
        }
    ]
    assert chat_tools(None) is None
    assert chat_tool_choice({"type": "function", "name": "add"}) == {
        "type": "function",
        "function": {"name": "add"},
    }
    assert chat_tool_choice("required") == "required"
    for bad in ([{"type": "file_search"}], "add", [3]):
        with pytest.raises(ValueError):
            chat_tools(bad)
    for bad_item in (
        {"type": "function_call", "name": "add"},
        {"type": "function_call_output", "output": "1"},
    ):
        with pytest.raises(ValueError):
            input_messages([bad_item])


def test_a_reasoning_item_goes_with_the_assistant_turn_that_follows_it() -> None:
    """Output items sent back as input (a client keeping the context itself): a reasoning item's
    text is the next assistant message's reasoning_content; with no assistant turn next, an assistant
    turn of its own (a response cut off while thinking, as its stored conversation has it)."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "check "}, {"type": "reasoning_text", "text": "it"}]}  # fmt: skip
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    assert input_messages([{"role": "user", "content": "q"}, thought, answer]) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "check it"},
    ]
    assert input_messages([thought, call])[0]["reasoning_content"] == "check it"
    assert input_messages(
        [{"role": "user", "content": "q"}, thought, {"role": "user", "content": "and?"}]
    ) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "check it"},
        {"role": "user", "content": "and?"},
    ]
    summary_only = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]}
    assert input_messages([summary_only, answer])[0]["reasoning_content"] == "short"
    with pytest.raises(ValueError, match="reasoning item"):
        input_messages([{"type": "reasoning", "content": "not parts"}, answer])


def test_a_responses_output_sent_back_as_input_is_the_turn_it_was() -> None:
    """The usual tool loop sends a response's output items back as the next input: its thinking,
    text and call are one assistant turn, as previous_response_id's stored conversation has it (two
    messages rendered another prompt, and missed the cache)."""
    from worker.responses_output import Events, OutputItems

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for deltas in (
        [{"reasoning": "need weather"}, {"content": "Let me check."}, {"tool_calls": [call]}],
        [{"reasoning": "R1 "}, {"content": "Let me check."}, {"reasoning": "R2"}, {"tool_calls": [call]}],
        [{"reasoning": "cut off while thinking"}],  # max_output_tokens reached before any answer
    ):  # NOTE: the second as gpt-oss may answer: analysis, a commentary preamble, analysis, the call
        items = OutputItems(Events())
        for delta in deltas:
            items.delta(delta)
        items.close("completed")
        assert input_messages(items.items) == [items.assistant_message()]
