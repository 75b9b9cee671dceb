"""Copy-ready client configurations for the embedded server (OpenAI-compatible, base URL .../v1),
in the shapes docs/editors.md explains: Continue's config.yaml, Zed's settings.json, VS Code's
chatLanguageModels.json (Copilot Chat "Custom Endpoint") and aider's command line."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ninfer_core.capabilities import Capabilities


@dataclass(frozen=True)
class Snippet:
    client: str
    where: str  # which file or shell it goes into
    text: str


def snippets(base_url: str, api_key: str, model: str, context: int, can: Capabilities) -> list[Snippet]:
    """`can`: what the model supports; a snippet never advertises tools or images it would not take."""
    v1 = f"{base_url}/v1"
    answer = min(8192, context // 4)  # the answer budget clients reserve out of the context
    continue_capabilities = [name for name, on in (("tool_use", can.tools), ("image_input", can.vision)) if on]
    continue_yaml = "\n".join([
        "name: ninfer", "version: 0.0.1", "schema: v1", "models:",
        f"  - name: {model} (ninfer)", "    provider: openai", f"    model: {model}",
        f"    apiBase: {v1}", f"    apiKey: {api_key}", "    roles: [chat, edit, apply]",
        f"    capabilities: [{', '.join(continue_capabilities)}]", "    defaultCompletionOptions:",
        f"      contextLength: {context}", f"      maxTokens: {answer}",
    ])
    zed = {"language_models": {"openai_compatible": {"ninfer": {
        "api_url": v1,
        "available_models": [{"name": model, "display_name": f"{model} (ninfer)", "max_tokens": context,
                              "max_output_tokens": answer,
                              "capabilities": {"tools": can.tools, "images": can.vision, "parallel_tool_calls": False,
                                               "prompt_cache_key": False}}],
    }}}}
    vscode = [{"name": "ninfer", "vendor": "customendpoint", "apiKey": api_key, "apiType": "chat-completions",
               "models": [{"id": model, "name": f"{model} (ninfer)", "url": f"{v1}/chat/completions",
                           "toolCalling": can.tools, "vision": can.vision, "thinking": can.thinking,
                           "maxInputTokens": context - answer, "maxOutputTokens": answer}]}]
    aider = f"aider --model openai/{model} --openai-api-base {v1} --openai-api-key {api_key}"
    return [
        Snippet("Continue", "~/.continue/config.yaml", continue_yaml),
        Snippet("Zed", f"settings.json; the key goes in the agent panel or NINFER_API_KEY={api_key}",
                json.dumps(zed, indent=2)),
        Snippet("VS Code", "Chat: Manage Language Models → Add → Custom Endpoint, then chatLanguageModels.json",
                json.dumps(vscode, indent=2)),
        Snippet("aider", "shell (see docs/editors.md for .aider.model.metadata.json)", aider),
    ]
