"""The tool set of the benchmark's coding-agent trace: 24 tools with JSON schemas.

Written for this benchmark in the shape coding agents use (a name, a paragraph of guidance,
an input schema); `detail` repeats usage notes so a full run can reach an agent-sized prompt.
"""

from __future__ import annotations

from typing import Any


def _schema(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }


def _s(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **extra}


def _i(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **extra}


def _b(desc: str) -> dict[str, Any]:
    return {"type": "boolean", "description": desc}


_PATH = _s("Absolute path of the file, inside the working directory.")

# name, description, properties, required
_TOOLS: list[tuple[str, str, dict[str, Any], list[str]]] = [
    (
        "read_file",
        "Read a text file and return it with line numbers. Use offset and limit for "
        "long files instead of reading them whole.",
        {
            "path": _PATH,
            "offset": _i("First line to return, 1-based.", minimum=1),
            "limit": _i("How many lines to return.", minimum=1),
        },
        ["path"],
    ),
    (
        "write_file",
        "Create or overwrite a file with the given content. Read an existing file "
        "before overwriting it.",
        {"path": _PATH, "content": _s("The whole new content.")},
        ["path", "content"],
    ),
    (
        "edit_file",
        "Replace one exact occurrence of old_text with new_text in a file. Fails if "
        "old_text occurs zero or several times; include more context to make it unique.",
        {
            "path": _PATH,
            "old_text": _s("Text to replace, exactly as in the file."),
            "new_text": _s("Replacement text."),
            "replace_all": _b("Replace every occurrence instead of exactly one."),
        },
        ["path", "old_text", "new_text"],
    ),
    (
        "multi_edit",
        "Apply several edits to one file atomically, in order.",
        {
            "path": _PATH,
            "edits": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "old_text": _s("Text to replace."),
                        "new_text": _s("Replacement."),
                    },
                    "required": ["old_text", "new_text"],
                },
            },
        },
        ["path", "edits"],
    ),
    (
        "list_dir",
        "List the entries of a directory, directories first.",
        {"path": _PATH, "ignore": {"type": "array", "items": _s("A glob to leave out.")}},
        ["path"],
    ),
    (
        "glob",
        "Find files whose path matches a glob pattern such as '**/*.py', newest first.",
        {"pattern": _s("The glob pattern."), "path": _s("Directory to search from.")},
        ["pattern"],
    ),
    (
        "grep",
        "Search file contents with a regular expression and return matching lines.",
        {
            "pattern": _s("A regular expression."),
            "path": _s("File or directory to search."),
            "glob": _s("Only files matching this glob."),
            "context": _i("Lines of context around each match.", minimum=0, maximum=20),
            "case_insensitive": _b("Ignore case."),
        },
        ["pattern"],
    ),
    (
        "run_shell",
        "Run a shell command in the working directory and return its output. "
        "Commands that change files, install packages or reach the network need a reason.",
        {
            "command": _s("The command line."),
            "timeout_s": _i("Stop after this many seconds.", minimum=1, maximum=600),
            "reason": _s("One sentence on why this command is needed."),
        },
        ["command"],
    ),
    (
        "run_tests",
        "Run pytest on the given paths or node ids and return the summary.",
        {
            "targets": {"type": "array", "items": _s("A path or node id.")},
            "keyword": _s("Only tests matching this -k expression."),
            "fail_fast": _b("Stop at the first failure."),
        },
        [],
    ),
    (
        "lint",
        "Run ruff check on paths and return the findings.",
        {"paths": {"type": "array", "items": _s("A path.")}, "fix": _b("Apply safe fixes.")},
        ["paths"],
    ),
    (
        "format_code",
        "Run ruff format on paths.",
        {"paths": {"type": "array", "items": _s("A path.")}},
        ["paths"],
    ),
    ("git_status", "Show the working tree status.", {}, []),
    (
        "git_diff",
        "Show the diff of the working tree or of a commit range.",
        {
            "range": _s("A commit range such as HEAD~1..HEAD."),
            "path": _s("Limit to this path."),
            "staged": _b("Show the staged diff."),
        },
        [],
    ),
    (
        "git_log",
        "Show recent commits, one line each.",
        {"limit": _i("How many commits.", minimum=1, maximum=200), "path": _s("Limit to a path.")},
        [],
    ),
    (
        "git_commit",
        "Stage the given paths and commit them with a message.",
        {
            "paths": {"type": "array", "items": _s("A path to stage."), "minItems": 1},
            "message": _s("The commit message: what changed and why."),
        },
        ["paths", "message"],
    ),
    (
        "todo_write",
        "Replace the task list shown to the user.",
        {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": _s("The task."),
                        "status": _s("Its state.", enum=["pending", "in_progress", "completed"]),
                        "id": _s("A stable id."),
                    },
                    "required": ["content", "status", "id"],
                },
            }
        },
        ["todos"],
    ),
    (
        "ask_user",
        "Ask the user a question and wait for the answer. Use only when the task "
        "cannot go on without a decision.",
        {"question": _s("The question."), "options": {"type": "array", "items": _s("A choice.")}},
        ["question"],
    ),
    (
        "search_symbols",
        "Find where a Python symbol is defined and used.",
        {
            "name": _s("Function, class or variable name."),
            "kind": _s("What to look for.", enum=["definition", "references", "both"]),
        },
        ["name"],
    ),
    (
        "python_eval",
        "Evaluate a short Python snippet in the project's virtual environment.",
        {"code": _s("The snippet; print what you need."), "timeout_s": _i("Limit.", minimum=1)},
        ["code"],
    ),
    (
        "cache_stats",
        "Fetch /v1/cache/stats from a running proxy.",
        {"url": _s("Base URL of the proxy.", format="uri")},
        ["url"],
    ),
    (
        "http_request",
        "Send an HTTP request to a local server and return status and body.",
        {
            "method": _s("The method.", enum=["GET", "POST", "DELETE"]),
            "url": _s("The URL."),
            "json_body": {"type": "object", "description": "A JSON body to send."},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        ["method", "url"],
    ),
    (
        "spawn_subagent",
        "Start a helper with its own context on a self-contained task and return its final report.",
        {
            "description": _s("Three to five words."),
            "prompt": _s("The full task for the helper."),
            "tools": {"type": "array", "items": _s("A tool name the helper may use.")},
        },
        ["description", "prompt"],
    ),
    (
        "notebook_edit",
        "Replace, insert or delete one cell of a Jupyter notebook.",
        {
            "path": _PATH,
            "cell": _i("Cell index.", minimum=0),
            "source": _s("New source."),
            "mode": _s("What to do.", enum=["replace", "insert", "delete"]),
        },
        ["path", "cell"],
    ),
    (
        "open_issue",
        "Draft an issue for the project tracker; it is shown, not filed.",
        {
            "title": _s("A short title."),
            "body": _s("What happens, what should, how to reproduce."),
            "labels": {"type": "array", "items": _s("A label.")},
        },
        ["title", "body"],
    ),
]

TOOL_NAMES: tuple[str, ...] = tuple(t[0] for t in _TOOLS)


def tool_definitions(detail_sentences: list[str], compact: bool = False) -> list[dict[str, Any]]:
    """Anthropic tool definitions; tool i gets `detail_sentences[i]` appended if present.

    `compact` drops property descriptions and schema boilerplate, as terser clients send.
    """
    out = []
    for i, (name, desc, props, required) in enumerate(_TOOLS):
        extra = detail_sentences[i] if i < len(detail_sentences) else ""
        schema = _schema(props, required)
        if compact:
            schema = {"type": "object", "properties": _strip(props), "required": required}
        out.append(
            {
                "name": name,
                "description": desc + ("\n\n" + extra if extra else ""),
                "input_schema": schema,
            }
        )
    return out


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "description"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
