from agentab.cli import main

main()
