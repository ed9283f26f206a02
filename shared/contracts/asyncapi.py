"""The AsyncAPI 3.0 document of hetsched, generated from the contract models (docs/asyncapi.json)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shared.contracts.envelope import EventEnvelope
from shared.contracts.permissions import NODE_SCOPED_EVENTS
from shared.contracts.registry import EVENTS, RPCS
from shared.contracts.subjects import NODE_SCOPED, TENANT_SCOPED, Subjects


def _schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def asyncapi_document(*, version: str, subjects: Subjects | None = None) -> dict[str, Any]:
    """Channels for every request subject (request and reply messages) and every event subject
    (the envelope with its payload model)."""
    subjects = subjects or Subjects()
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    envelope = _schema(EventEnvelope, schemas)
    for rpc, (request, reply) in sorted(RPCS.items(), key=lambda item: item[0].value):
        key = rpc.value.replace(".", "_")
        messages[f"{key}_request"] = {"name": request.__name__, "payload": _schema(request, schemas)}
        messages[f"{key}_reply"] = {"name": reply.__name__, "payload": _schema(reply, schemas)}
        channels[key] = {
            "address": subjects.rpc(rpc),
            "messages": {
                "request": {"$ref": f"#/components/messages/{key}_request"},
                "reply": {"$ref": f"#/components/messages/{key}_reply"},
            },
        }
        operations[key] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "messages": [{"$ref": f"#/channels/{key}/messages/request"}],
            "reply": {
                "channel": {"$ref": f"#/channels/{key}"},
                "messages": [{"$ref": f"#/channels/{key}/messages/reply"}],
            },
        }
        scope = "tenant" if rpc in TENANT_SCOPED else "node" if rpc in NODE_SCOPED else None
        if scope is not None:  # the form a gateway's (tenant) or an agent's (node) credential may use
            channels[f"{key}_by_{scope}"] = {
                "address": f"{subjects.rpc(rpc)}.{{{scope}}}",
                "description": f"As {subjects.rpc(rpc)}, for one {scope}: a body naming another is `forbidden`.",
                "parameters": {scope: {"description": f"the {scope} as a subject token (API.md)"}},
                "messages": dict(channels[key]["messages"]),
            }
    for (context, event), model in sorted(EVENTS.items(), key=lambda item: (item[0][0].value, item[0][1])):
        key = f"events_{context.value}_{event}"
        payload = _schema(model, schemas)
        messages[key] = {
            "name": f"{context.value}.{event}",
            "summary": (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else "",
            "payload": {"allOf": [envelope, {"type": "object", "properties": {"payload": payload}}]},
            "headers": {
                "type": "object",
                "properties": {"Nats-Msg-Id": {"type": "string", "description": "= event_id"}},
            },
        }
        channels[key] = {
            "address": subjects.event(context, event),
            "messages": {"event": {"$ref": f"#/components/messages/{key}"}},
        }
        if event in NODE_SCOPED_EVENTS.get(context, ()):  # published per node (an agent's own subject)
            channels[key]["address"] = f"{subjects.event(context, event)}.{{node}}"
            channels[key]["parameters"] = {"node": {"description": "the node the payload names, as a subject token"}}
        operations[key] = {"action": "send", "channel": {"$ref": f"#/channels/{key}"}}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "hetsched",
            "version": version,
            "description": "Request/reply subjects (core NATS) and events (JetStream) of hetsched.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }
