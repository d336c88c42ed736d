"""agentab: replay coding-agent traffic, A/B a decode path at a fixed GPU count."""

__version__ = "0.1.0"
