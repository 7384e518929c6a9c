from ablate.app import main

main()
