"""Agent-native RL (the recipe's MiniMax-M2 -> M2.5 half): environments, the tool rendering,
multi-turn trajectories and their windowed FIFO scheduler.

    envs/      the ``Environment`` interface, its registry and the bundled environments
    render.py  one rendering of tools and tool calls over the model's chat template, one parser
    rollout.py multi-turn sampling, token-exact (the ids trained on are the ids sampled)
"""
