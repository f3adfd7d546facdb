"""furlong.tools: built-in tools for multi-turn rollouts (the calculator recipe) and Qwen3-style tool calls."""
