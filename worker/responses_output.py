"""A Responses API answer's ``output`` items, built from chat-shaped deltas (``{"content": ...}`` and
``{"tool_calls": [...]}``, what worker.tool_calls produces), and the stream events that announce
them: an assistant ``message`` with one ``output_text`` part, and one ``function_call`` item per
call, each opened, filled and closed in order. A non-streamed answer goes through the same steps
and keeps only the items."""

from __future__ import annotations

import uuid
from typing import Any

from worker.openai_format import sse_json


class Events:
    """Server-sent events of one streamed response, numbered as the API numbers them."""

    def __init__(self) -> None:
        self.seq = 0

    def send(self, kind: str, **fields: Any) -> bytes:
        data = sse_json({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class OutputItems:
    def __init__(self, events: Events, logprobs: bool = False) -> None:
        self.events = events
        self.logprobs = logprobs  # message parts carry their tokens' logprobs (include asked for them)
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being generated
        self._calls: dict[int, dict] = {}  # chat tool call index -> its function_call item

    # ------------------------------------------------------------------ building
    def open_message(self) -> list[bytes]:
        out = self._close_open()
        item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self._open = item
        self.items.append(item)
        part = {
            "type": "output_text",
            "text": "",
            "annotations": [],
            **({"logprobs": []} if self.logprobs else {}),
        }
        out.append(
            self.events.send("response.output_item.added", output_index=len(self.items) - 1, item=item)
        )
        out.append(self.events.send("response.content_part.added", **self._where(), part=part))
        item["content"].append(part)
        return out

    def _open_reasoning(self) -> list[bytes]:
        out = self._close_open()
        part = {"type": "reasoning_text", "text": ""}
        item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "status": "in_progress", "summary": [],
                "content": [part]}  # fmt: skip
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.events.send("response.output_item.added", output_index=index, item=item))
        out.append(self.events.send("response.content_part.added", **self._where(), part=part))
        return out

    def delta(self, delta: dict) -> list[bytes]:
        """Events for one chat delta (thinking, content text, or tool call headers / argument pieces)."""
        out: list[bytes] = []
        thought = delta.get("reasoning")
        if thought:
            if self._open is None or self._open["type"] != "reasoning":
                out += self._open_reasoning()
            assert self._open is not None
            self._open["content"][0]["text"] += thought
            out.append(self.events.send("response.reasoning_text.delta", **self._where(), delta=thought))
        text = delta.get("content")
        if text:
            if self._open is None or self._open["type"] != "message":
                out += self.open_message()
            assert self._open is not None
            part = self._open["content"][0]
            part["text"] += text
            logprobs = delta.get("logprobs") or []  # its tokens' numbers, when they were asked for
            if "logprobs" in part:
                part["logprobs"] += logprobs
            out.append(
                self.events.send("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)
            )
        for call in delta.get("tool_calls", ()):
            fn = call.get("function", {})
            if "id" in call:  # a new call
                out += self._close_open()
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                        "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}  # fmt: skip
                self._open = self._calls[call["index"]] = item
                self.items.append(item)
                index = len(self.items) - 1
                out.append(self.events.send("response.output_item.added", output_index=index, item=item))
            item = self._calls[call["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(self.events.send("response.function_call_arguments.delta", item_id=item["id"],
                                            output_index=self.items.index(item), delta=fn["arguments"]))  # fmt: skip
        return out

    def add_logprobs(self, entries: list[dict]) -> list[bytes]:
        """Entries for tokens that added no text (a stop string's): onto the last message's part, if
        it has logprobs, and in a delta of no text while that message is open, so a client that
        gathers them from the deltas has them all, as chat's last chunk carries them."""
        parts = [i["content"][0] for i in self.items if i["type"] == "message"]
        if not parts or "logprobs" not in parts[-1]:
            return []
        parts[-1]["logprobs"] += entries
        if self._open is None or self._open["content"][0] is not parts[-1]:
            return []
        return [self.events.send("response.output_text.delta", **self._where(), delta="", logprobs=entries)]

    def close(self, status: str, empty_message: bool = True) -> list[bytes]:
        """Close the open item and mark every item ``status`` (completed or incomplete)."""
        out: list[bytes] = []
        # NOTE: nothing was generated: still one (empty) message, as the API has (not for a failure's close)
        if not self.items and empty_message:
            out += self.open_message()  # NOTE: its opening events too: a stream's numbers run on
        out += self._close_open(status)
        for item in self.items:
            item["status"] = status
        return out

    # ------------------------------------------------------------------ results
    def assistant_message(self) -> dict:
        """The answer as one chat message, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        thought = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        message = {"role": "assistant", "content": text}
        if calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": calls}
        if thought:  # NOTE: the name chat templates read (Qwen3's renders it back in a tool loop)
            message["reasoning_content"] = thought
        return message

    def _where(self) -> dict:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self.items.index(self._open), "content_index": 0}

    def _close_open(self, status: str = "completed") -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        send = self.events.send
        if item["type"] in ("message", "reasoning"):  # one text part each
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                done = send("response.output_text.done", **where, text=part["text"],
                            logprobs=part.get("logprobs", []))  # fmt: skip
            else:
                done = send("response.reasoning_text.done", **where, text=part["text"])
            return [
                done,
                send("response.content_part.done", **where, part=part),
                send("response.output_item.done", output_index=index, item=item),
            ]
        return [
            send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 arguments=item["arguments"]),
            send("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip
