"""GenRM judging and Swiss-round reference selection (MiniMax-M1): prompts, parsers,
consistency rules, judges, tournaments, validation and the length-bias monitor."""
