"""The structured-outputs benchmark's suite (bench_structured.py): JSON schemas of the kinds users send,
each with a natural prompt, and the tools of its tool-calling figure.

Kinds covered: nested objects, arrays with minItems / maxItems, enums, anyOf, $ref / $defs, string
patterns, string formats, numeric bounds, optional fields, booleans, nullable fields and const. Every
schema is a valid JSON Schema (draft 2020-12 unless it says otherwise) and compiles in a GrammarCache
(tests/unit/test_structured_schemas.py). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str  # OpenAI's json_schema name: [a-zA-Z0-9_-]{1,64}
    kinds: tuple[str, ...]  # the schema features it exercises
    prompt: str
    schema: dict[str, Any]


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema; every property required unless `required` says otherwise."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, "additionalProperties": False,
            **extra}


S = {"type": "string"}
S40 = {"type": "string", "maxLength": 40}
S80 = {"type": "string", "maxLength": 80}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}

SCHEMAS: list[SchemaCase] = [
    SchemaCase("person", ("object", "numeric bounds"),
               "Return a JSON object describing a fictional person: name and age.",
               _obj({"name": S40, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    SchemaCase("book", ("object", "array", "numeric bounds"),
               "Return a JSON object describing a classic novel: title, author, year published and a few "
               "genres.",
               _obj({"title": S80, "author": S40,
                     "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                     "genres": {"type": "array", "items": S40, "minItems": 1, "maxItems": 3}})),
    SchemaCase("weather_report", ("object", "enum", "numeric bounds"),
               "Return a JSON object describing today's weather in Paris.",
               _obj({"city": S40, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                     "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy", "windy"]},
                     "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100}})),
    SchemaCase("address", ("nested object", "pattern"),
               "Return a JSON object describing a made-up company with its postal address.",
               _obj({"company": S40,
                     "address": _obj({"street": S80, "city": S40,
                                      "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "country": S40})})),
    SchemaCase("order", ("nested object", "array", "numeric bounds"),
               "Return a JSON object describing an online order of two or three items.",
               _obj({"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                     "items": {"type": "array", "minItems": 2, "maxItems": 3,
                               "items": _obj({"product": S40,
                                              "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                                              "unit_price": {"type": "number", "minimum": 0}})},
                     "paid": BOOL})),
    SchemaCase("sentiment", ("enum", "numeric bounds"),
               "Return a JSON object with the sentiment of this review: 'The food was great but the "
               "service was slow.'",
               _obj({"sentiment": {"enum": ["positive", "negative", "mixed", "neutral"]},
                     "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    SchemaCase("event", ("format", "object"),
               "Return a JSON object describing a conference: its name, start date and a contact email.",
               _obj({"name": S80, "start_date": {"type": "string", "format": "date"},
                     "contact": {"type": "string", "format": "email"}})),
    SchemaCase("meeting", ("format", "array"),
               "Return a JSON object describing a team meeting: title, when it starts and who attends.",
               _obj({"title": S80, "starts_at": {"type": "string", "format": "date-time"},
                     "attendees": {"type": "array", "items": S40, "minItems": 1, "maxItems": 4}})),
    SchemaCase("server", ("format", "numeric bounds", "boolean"),
               "Return a JSON object describing a web server: host name, IPv4 address, port and whether "
               "TLS is on.",
               _obj({"hostname": {"type": "string", "format": "hostname"},
                     "ip": {"type": "string", "format": "ipv4"},
                     "port": {"type": "integer", "minimum": 1, "maximum": 65535}, "tls": BOOL})),
    SchemaCase("bookmark", ("format", "optional"),
               "Return a JSON object describing a bookmark of a useful website.",
               _obj({"url": {"type": "string", "format": "uri"}, "title": S80,
                     "tags": {"type": "array", "items": S40, "maxItems": 3}}, required=["url", "title"])),
    SchemaCase("ticket", ("format", "enum", "pattern"),
               "Return a JSON object describing a support ticket about a login problem.",
               _obj({"id": {"type": "string", "format": "uuid"},
                     "priority": {"enum": ["low", "medium", "high", "urgent"]},
                     "summary": S80, "component": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"}})),
    SchemaCase("shape", ("anyOf", "const"),
               "Return a JSON object describing a geometric shape: either a circle or a rectangle.",
               {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                          _obj({"kind": {"const": "rectangle"}, "width": {"type": "number", "minimum": 0},
                                "height": {"type": "number", "minimum": 0}})]}),
    SchemaCase("payment", ("anyOf", "nested object", "pattern"),
               "Return a JSON object describing how a customer paid: by card or by bank transfer.",
               _obj({"amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]},
                     "method": {"anyOf": [
                         _obj({"card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                         _obj({"iban": {"type": "string",
                                        "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}})]}})),
    SchemaCase("contact_value", ("anyOf", "format"),
               "Return a JSON object with a person's name and one way to reach them (email or phone).",
               _obj({"name": S40, "reach": {"anyOf": [{"type": "string", "format": "email"},
                                                      {"type": "string", "pattern": "^\\+[0-9]{8,14}$"}]}})),
    SchemaCase("family", ("$ref", "$defs", "array"),
               "Return a JSON object describing a small family: two parents and their children.",
               {"$defs": {"member": _obj({"name": S40, "age": {"type": "integer", "minimum": 0,
                                                                  "maximum": 110}})},
                **_obj({"parents": {"type": "array", "items": {"$ref": "#/$defs/member"}, "minItems": 2,
                                    "maxItems": 2},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/member"}, "maxItems": 4}})}),
    SchemaCase("route", ("$ref", "$defs", "numeric bounds"),
               "Return a JSON object describing a flight route between two airports.",
               {"$defs": {"airport": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                           "city": S40})},
                **_obj({"origin": {"$ref": "#/$defs/airport"}, "destination": {"$ref": "#/$defs/airport"},
                        "distance_km": {"type": "integer", "minimum": 1, "maximum": 20000}})}),
    SchemaCase("org_chart", ("$ref", "$defs", "nested object", "optional"),
               "Return a JSON object describing a small team: its lead and up to three members.",
               {"$defs": {"employee": _obj({"name": S40, "title": S40, "email": {"type": "string",
                                                                                   "format": "email"}},
                                           required=["name", "title"])},
                **_obj({"team": S40, "lead": {"$ref": "#/$defs/employee"},
                        "members": {"type": "array", "items": {"$ref": "#/$defs/employee"},
                                    "maxItems": 3}})}),
    SchemaCase("product", ("optional", "numeric bounds", "boolean"),
               "Return a JSON object describing a laptop for sale.",
               _obj({"name": S80, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                     "in_stock": BOOL, "discount_pct": {"type": "integer", "minimum": 0, "maximum": 90},
                     "color": S40}, required=["name", "price", "in_stock"])),
    SchemaCase("user_profile", ("nullable", "optional"),
               "Return a JSON object describing a user profile; the middle name may be unknown.",
               _obj({"first_name": S40, "middle_name": {"type": ["string", "null"], "maxLength": 40},
                     "last_name": S40, "nickname": S40},
                    required=["first_name", "middle_name", "last_name"])),
    SchemaCase("task", ("nullable", "format", "enum"),
               "Return a JSON object describing a to-do item; it may not have a due date.",
               _obj({"title": S80, "status": {"enum": ["todo", "doing", "done"]},
                     "due": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}})),
    SchemaCase("feature_flags", ("boolean", "object"),
               "Return a JSON object with the feature flags of a mobile app: dark mode, notifications, "
               "beta features.",
               _obj({"dark_mode": BOOL, "notifications": BOOL, "beta": BOOL})),
    SchemaCase("api_version", ("const", "enum"),
               "Return a JSON object describing an API response envelope for a successful call.",
               _obj({"api_version": {"const": "v2"}, "status": {"enum": ["ok", "error"]},
                     "request_id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}})),
    SchemaCase("coordinates", ("numeric bounds", "object"),
               "Return a JSON object with the latitude and longitude of Tokyo.",
               _obj({"latitude": {"type": "number", "minimum": -90, "maximum": 90},
                     "longitude": {"type": "number", "minimum": -180, "maximum": 180}})),
    SchemaCase("rgb_color", ("array", "numeric bounds"),
               "Return a JSON object describing the colour orange as RGB values.",
               _obj({"name": S40, "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                      "maximum": 255},
                                          "minItems": 3, "maxItems": 3}})),
    SchemaCase("keywords", ("array", "string length"),
               "Return a JSON object with three to five keywords for an article about renewable energy.",
               _obj({"keywords": {"type": "array", "minItems": 3, "maxItems": 5,
                                  "items": {"type": "string", "minLength": 2, "maxLength": 30}}})),
    SchemaCase("recipe", ("nested object", "array", "numeric bounds"),
               "Return a JSON object describing a simple pancake recipe.",
               _obj({"name": S40, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                     "ingredients": {"type": "array", "minItems": 2, "maxItems": 6,
                                     "items": _obj({"item": S40, "amount": S40})},
                     "minutes": {"type": "integer", "minimum": 1, "maximum": 240}})),
    SchemaCase("movie_rating", ("numeric bounds", "enum", "pattern"),
               "Return a JSON object rating the movie 'The Matrix'.",
               _obj({"title": S80, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                     "age_rating": {"enum": ["G", "PG", "PG-13", "R"]},
                     "runtime": {"type": "string", "pattern": "^[0-9]h[0-5][0-9]m$"}})),
    SchemaCase("classification", ("enum", "array"),
               "Return a JSON object classifying this email: 'You won a free cruise, click here now!'",
               _obj({"label": {"enum": ["spam", "ham"]},
                     "reasons": {"type": "array", "items": S80, "minItems": 1, "maxItems": 3}})),
    SchemaCase("invoice", ("nested object", "$ref", "format", "numeric bounds"),
               "Return a JSON object describing an invoice with a billing date, a customer and its lines.",
               {"$defs": {"line": _obj({"description": S80,
                                        "amount": {"type": "number", "minimum": 0, "maximum": 100000}})},
                **_obj({"invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                        "date": {"type": "string", "format": "date"},
                        "customer": _obj({"name": S40, "vat_id": {"type": ["string", "null"],
                                                                  "pattern": "^[A-Z]{2}[0-9]{8,12}$"}}),
                        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1,
                                  "maxItems": 3}})}),
    SchemaCase("config_file", ("nested object", "optional", "boolean", "numeric bounds"),
               "Return a JSON object with the configuration of a logging service.",
               _obj({"service": S40,
                     "logging": _obj({"level": {"enum": ["debug", "info", "warning", "error"]},
                                      "json": BOOL, "max_files": {"type": "integer", "minimum": 1,
                                                                  "maximum": 100}},
                                     required=["level"]),
                     "retention_days": {"type": "integer", "minimum": 1, "maximum": 365}},
                    required=["service", "logging"])),
    SchemaCase("quiz_question", ("array", "numeric bounds", "string length"),
               "Return a JSON object with a multiple-choice question about the solar system.",
               _obj({"question": {"type": "string", "minLength": 10, "maxLength": 120},
                     "options": {"type": "array", "items": S40, "minItems": 4, "maxItems": 4},
                     "answer_index": {"type": "integer", "minimum": 0, "maximum": 3}})),
    SchemaCase("measurement", ("anyOf", "nullable", "numeric bounds"),
               "Return a JSON object with a sensor reading; the value may be missing.",
               _obj({"sensor": {"type": "string", "pattern": "^S[0-9]{3}$"},
                     "value": {"anyOf": [{"type": "number", "minimum": -1000, "maximum": 1000},
                                         {"type": "null"}]},
                     "unit": {"enum": ["C", "F", "K"]}})),
    SchemaCase("answer_bool", ("boolean", "const", "string length"),
               "Return a JSON object answering: is the Earth round? Give a short explanation.",
               _obj({"question_id": {"const": 1}, "answer": BOOL, "explanation": {"type": "string",
                                                                                  "maxLength": 100}})),
    SchemaCase("loose_note", ("free object", "optional"),
               "Return a JSON object describing a note with a title and free-form text.",
               {"type": "object", "properties": {"title": S, "body": S}, "required": ["title"]}),
]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": _obj({"city": S40, "unit": {"enum": ["celsius", "fahrenheit"]}},
                           required=["city"])}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic operation on two numbers.",
        "parameters": _obj({"a": NUM, "b": NUM, "op": {"enum": ["add", "subtract", "multiply", "divide"]}})}},
    {"type": "function", "function": {
        "name": "web_search", "description": "Search the web.",
        "parameters": _obj({"query": S80, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                           required=["query"])}},
]

# (prompt, the tool a named tool_choice names)
TOOL_PROMPTS: list[tuple[str, str]] = [
    ("What's the weather like in Berlin right now?", "get_weather"),
    ("What is 37 times 41?", "calculator"),
    ("Find me recent news about the James Webb telescope.", "web_search"),
    ("Is it going to be cold in Oslo today, in fahrenheit?", "get_weather"),
    ("Divide 1024 by 16.", "calculator"),
    ("Look up the best hiking trails near Denver, five results.", "web_search"),
]


def tool_parameters(name: str) -> dict[str, Any]:
    for t in TOOLS:
        if t["function"]["name"] == name:
            params: dict[str, Any] = t["function"]["parameters"]
            return params
    raise KeyError(name)
