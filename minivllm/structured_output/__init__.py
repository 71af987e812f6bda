"""Structured outputs: grammar compilation and token masks (llguidance), and the reasoning hook that
attaches a grammar once a thinking model's answer begins."""
