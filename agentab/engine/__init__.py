"""agentab.engine"""
