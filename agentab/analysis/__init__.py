"""agentab.analysis"""
