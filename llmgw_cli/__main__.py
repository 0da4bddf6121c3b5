from llmgw_cli.cli.main import main

main()
