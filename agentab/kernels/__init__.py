"""agentab.kernels"""
