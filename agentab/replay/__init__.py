"""agentab.replay"""
