"""The event-stream bookkeeping under the passthrough's stream faults
(test_upstream_faults.py), on the byte splits a socket may produce."""

from __future__ import annotations

from proxy.upstream.relay import HELD_MAX, EventStream


def test_event_stream_passes_whole_events_and_notices_the_final_one():
    events = EventStream()
    assert events.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert events.feed(b": 2}\r\n\r\nevent: message_stop\ndata: {}\n") == b'data: {"b": 2}\r\n\r\n'
    assert (events.at_boundary, events.finished) == (True, False)
    assert events.feed(b"\n") == b"event: message_stop\ndata: {}\n\n"
    assert events.finished and not events.held
    done = EventStream()
    assert done.feed(b'data: {"x": "data: [DONE]"}\n\n') and not done.finished  # inside JSON
    assert done.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and done.finished


def test_event_stream_passes_an_oversized_event_on_unfinished():
    events = EventStream()
    big = b"data: " + b"x" * HELD_MAX
    assert events.feed(big) == big  # not held in memory without end
    assert not events.at_boundary  # so an error event must start with a blank line
    assert events.feed(b"x\n\ndata: 1") == b"x\n\n"
    assert events.at_boundary and events.held == b"data: 1"


def test_event_stream_knows_the_responses_final_events_and_numbering():
    events = EventStream(responses=True)
    created = b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, '
    events.feed(created + b'"response": {"id": "resp_a1", "output": [{"id": "msg_1"}]}}\n\n')
    assert (events.finished, events.response_id, events.next_sequence) == (False, "resp_a1", 1)
    chat = EventStream()  # other routes' streams are not scanned for them
    chat.feed(created + b'"response": {"id": "resp_a1"}}\n\n')
    assert (chat.response_id, chat.next_sequence) == (None, 0)
    # A type inside a string is escaped, so it is never taken for the event's own.
    events.feed(b'data: {"type": "x", "delta": "\\"type\\": \\"response.completed\\""}\n\n')
    assert not events.finished
    data_only = EventStream(responses=True)  # a server that sends no event lines
    data_only.feed(b'data: {"sequence_number": 7, "type": "response.incomplete"}\n\n')
    assert data_only.finished and data_only.next_sequence == 8
    for last in (b"response.completed", b"response.failed", b"error"):
        named = EventStream()
        named.feed(b"event: " + last + b"\ndata: {}\n\n")
        assert named.finished, last
