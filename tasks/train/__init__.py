"""Training stages on DeepSpeed: SFT short/long, DPO short/long and CISPO RL (MiniMax-01/M1)."""
