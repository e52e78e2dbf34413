"""Real-world JSON schemas for the structured-output suite, each with a request the model answers.

Strings carry maxLength (or an enum, pattern or format) and arrays maxItems, so every output is
bounded and generation must end by the grammar completing, never by the token budget.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    "address": ("Give a postal address in France.", {
        "type": "object",
        "properties": {"street": SHORT, "city": NAME, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "country": {"const": "FR"}},
        "required": ["street", "city", "postcode", "country"], "additionalProperties": False,
    }),
    "product": ("Describe a product in a shop.", {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "title": SHORT,
                       "price": {"type": "number", "minimum": 0, "maximum": 10000},
                       "in_stock": {"type": "boolean"}},
        "required": ["sku", "title", "price", "in_stock"], "additionalProperties": False,
    }),
    "order_nested": ("Write an order with a customer and two line items.", {
        "type": "object",
        "properties": {
            "customer": {"type": "object", "properties": {"name": NAME, "email": {"type": "string", "format": "email", "maxLength": 40}},
                         "required": ["name", "email"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {"product": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["product", "quantity"], "additionalProperties": False}},
        },
        "required": ["customer", "items"], "additionalProperties": False,
    }),
    "tags_bounded": ("List two to four tags for a blog post about cooking.", {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False,
    }),
    "enum_status": ("Report the status of a server.", {
        "type": "object", "properties": {"status": {"enum": ["up", "down", "degraded"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
        "required": ["status", "code"], "additionalProperties": False,
    }),
    "anyof_contact": ("Give a way to contact support.", {
        "type": "object",
        "properties": {"contact": {"anyOf": [
            {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}, "required": ["email"], "additionalProperties": False},
            {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"}}, "required": ["phone"], "additionalProperties": False},
        ]}},
        "required": ["contact"], "additionalProperties": False,
    }),
    "oneof_shape": ("Describe a geometric shape.", {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}},
             "required": ["kind", "side"], "additionalProperties": False},
        ],
    }),
    "optional_fields": ("Describe a book; the subtitle is optional.", {
        "type": "object",
        "properties": {"title": SHORT, "subtitle": SHORT, "year": {"type": "integer", "minimum": 1450, "maximum": 2030}},
        "required": ["title", "year"], "additionalProperties": False,
    }),
    "date_format": ("Give the date of an event.", {
        "type": "object", "properties": {"event": NAME, "date": {"type": "string", "format": "date"}},
        "required": ["event", "date"], "additionalProperties": False,
    }),
    "uuid_format": ("Give a record with an id.", {
        "type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "label": NAME},
        "required": ["id", "label"], "additionalProperties": False,
    }),
    "ipv4_format": ("Describe a network host.", {
        "type": "object", "properties": {"hostname": NAME, "ip": {"type": "string", "format": "ipv4"}},
        "required": ["hostname", "ip"], "additionalProperties": False,
    }),
    "numeric_ranges": ("Give a weather reading.", {
        "type": "object",
        "properties": {"temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 300}},
        "required": ["temperature_c", "humidity", "wind_kmh"], "additionalProperties": False,
    }),
    "matrix": ("Give a 2 by 2 matrix of small integers.", {
        "type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False,
    }),
    "ref_defs": ("Describe a family with two parents.", {
        "$defs": {"person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                             "required": ["name", "age"], "additionalProperties": False}},
        "type": "object", "properties": {"parents": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"$ref": "#/$defs/person"}}},
        "required": ["parents"], "additionalProperties": False,
    }),
    "tool_call": ("Call the weather tool for Paris.", {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                     "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False,
    }),
    "classification": ("Classify the sentiment of 'I love this phone'.", {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False,
    }),
    "entities": ("Extract the people from 'Alice met Bob in Rome'.", {
        "type": "object", "properties": {"people": {"type": "array", "maxItems": 4, "items": NAME}},
        "required": ["people"], "additionalProperties": False,
    }),
    "nullable": ("Describe a user whose middle name may be null.", {
        "type": "object", "properties": {"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 16}, "last": NAME},
        "required": ["first", "middle", "last"], "additionalProperties": False,
    }),
    "array_of_enums": ("List up to three primary colors.", {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["red", "yellow", "blue"]},
    }),
    "boolean_flags": ("Give feature flags for an app.", {
        "type": "object",
        "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}, "max_users": {"type": "integer", "minimum": 1, "maximum": 1000}},
        "required": ["dark_mode", "beta", "max_users"], "additionalProperties": False,
    }),
    "pattern_codes": ("Give a flight with its airline and airport codes.", {
        "type": "object",
        "properties": {"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                       "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["flight", "from", "to"], "additionalProperties": False,
    }),
    "allof_merge": ("Describe an employee.", {
        "allOf": [
            {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
            {"type": "object", "properties": {"salary": {"type": "integer", "minimum": 0, "maximum": 500000}}, "required": ["salary"]},
        ],
        "properties": {"name": NAME, "salary": {"type": "integer"}}, "additionalProperties": False,
    }),
}
